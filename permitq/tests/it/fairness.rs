//! Fairness keys: on a semaphore served by key, a tenant's burst does not make another tenant's
//! request wait behind it, and keys that wait are served in proportion to their weights.

use permitq_test_support as common;

use std::time::{Duration, Instant};

use common::{check_invariants, TestDb};
use permitq::{Request, SemaphoreSettings};

const SOON: Duration = Duration::from_secs(30);

/// The requests holding `semaphore` now: each external_id and fairness key.
async fn holders_on(
    conn: &tokio_postgres::Client,
    semaphore: &str,
) -> Vec<(String, Option<String>)> {
    conn.query(
        "SELECT external_id, fairness_key FROM permitq.permit_request
         WHERE state = 'acquired' AND permits ? $1",
        &[&semaphore],
    )
    .await
    .unwrap()
    .iter()
    .map(|row| (row.get(0), row.get(1)))
    .collect()
}

/// Waits until a request holds `semaphore`; its holders then.
async fn held(conn: &tokio_postgres::Client, semaphore: &str) -> Vec<(String, Option<String>)> {
    let deadline = Instant::now() + SOON;
    loop {
        let holders = holders_on(conn, semaphore).await;
        if !holders.is_empty() {
            return holders;
        }
        assert!(Instant::now() < deadline, "nothing granted on {semaphore}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Waits until one request holds `semaphore` (capacity 1), returns its external_id and fairness
/// key, and releases it.
async fn next_grant(
    client: &permitq::Client,
    conn: &tokio_postgres::Client,
    semaphore: &str,
) -> (String, Option<String>) {
    let mut holders = held(conn, semaphore).await;
    assert!(
        holders.len() <= 1,
        "capacity 1, yet {} hold it",
        holders.len()
    );
    let (id, key) = holders.swap_remove(0);
    client.release(&id).await.unwrap();
    (id, key)
}

/// Semaphore `name` of `capacity`, served by fairness key.
async fn keyed(client: &permitq::Client, name: &str, capacity: i32) {
    client
        .set_semaphore(
            name,
            capacity,
            &SemaphoreSettings::new().fairness_keys(true),
        )
        .await
        .unwrap();
}

/// `n` requests of key `key` on `semaphore` (one permit each), `{prefix}1` to `{prefix}n`,
/// inserted at once through the contract's insert point.
async fn queue_burst(
    conn: &tokio_postgres::Client,
    semaphore: &str,
    key: &str,
    prefix: &str,
    n: i64,
) {
    conn.execute(
        "INSERT INTO permitq.permit_request (external_id, permits, fairness_key)
         SELECT $3 || i, jsonb_build_object($1::text, 1), $2 FROM generate_series(1, $4::int8) i",
        &[&semaphore, &key, &prefix, &n],
    )
    .await
    .unwrap();
}

/// Tenant A submits 10,000 requests at once (a plain INSERT, the contract's insert point), then
/// tenant B one: B is granted after at most one more of A's (its share of two keys), not after
/// A's backlog; and the line (`waiters.position`, `explain`) shows it there while it waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_burst_does_not_make_anothers_request_wait_behind_it() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let conn = db.conn().await;
    keyed(&client, "gpu", 1).await;
    let worker = db.notified_worker("w1");
    client
        .submit(&Request::new("holder").permit("gpu", 1))
        .await
        .unwrap();
    assert_eq!(next_grant_kept(&conn, "gpu").await, "holder");
    queue_burst(&conn, "gpu", "A", "a-", 10_000).await;
    client
        .submit(&Request::new("b-1").permit("gpu", 1).fairness_key("B"))
        .await
        .unwrap();
    wait_examined(&conn, "gpu", 10_001).await;
    let first: Vec<String> = client
        .waiters("gpu", 3)
        .await
        .unwrap()
        .into_iter()
        .map(|w| w.external_id)
        .collect();
    assert_eq!(first, ["a-1", "b-1", "a-2"]);
    // Explain says, on its own line, what the key did to the place: B's request at its
    // arrival; A's third request 20s back, behind which of A's requests, and until when another
    // key's arrival goes first.
    let explained = client.explain("b-1").await.unwrap().unwrap();
    assert!(
        explained.semaphores.iter().any(|s| s.position == Some(2)
            && s.fairness.as_deref().is_some_and(|f| f.starts_with(
                "fairness key B, weight 1: placed at its arrival: when a worker examined it, no \
                 turn of its key was ahead of the line (requests granted while nobody waited \
                 take no turn). A request of a key with no turns outstanding at priority 0 \
                 goes behind it, whenever it arrives from now on"
            ))),
        "{explained:?}"
    );
    let behind = client.explain("a-3").await.unwrap().unwrap();
    let fairness = behind.semaphores[0].fairness.clone().unwrap_or_default();
    // (Until its place passes, a newcomer key still goes ahead of it; after, behind: either,
    // as the machine's speed has it.)
    assert!(
        behind.semaphores[0].position == Some(4)
            && fairness.starts_with(
                "fairness key A, weight 1: placed 20s after its arrival, by its key's turns \
                 that the line had not passed when a worker examined it here (a turn is 10s × \
                 count ÷ weight; the line's turn is the start of the latest turn granted \
                 there). Its key's requests that took their turns before it and still wait \
                 here: a-1, a-2 (their turns: 20s); its key's requests already granted or ended (held, released, cancelled, \
                 timed out or failed) count too, until the line passes their turns. A request \
                 of "
            )
            && (fairness.contains(
                "A request of a key with no turns outstanding at priority 0 goes ahead of it if \
                 it arrives in the next "
            ) || fairness.contains(
                "A request of a key with no turns outstanding at priority 0 goes behind it, \
                 whenever it arrives from now on"
            ))
            && fairness.ends_with("(a priority one step higher counts as one turn, 10s, earlier)."),
        "{behind:?}"
    );
    // Nothing of the kind where the semaphore is not keyed.
    assert!(
        !behind.semaphores[0].reason.contains("fairness"),
        "{behind:?}"
    );
    // The shares show how far back each key's next request goes: A's backlog of turns, and B's
    // one turn.
    let shares = client.key_shares("gpu").await.unwrap();
    let back = |key: &str| {
        shares
            .iter()
            .find(|k| k.fairness_key == key)
            .and_then(|k| k.placed_back)
            .unwrap_or_default()
    };
    assert!(
        back("A") > Duration::from_secs(9_000 * 10)
            && back("B") > Duration::from_secs(5)
            && back("B") <= Duration::from_secs(10),
        "{shares:?}"
    );
    client.release("holder").await.unwrap();
    let mut a_granted = 0;
    loop {
        let (id, key) = next_grant(&client, &conn, "gpu").await;
        if id == "b-1" {
            break;
        }
        assert_eq!(key.as_deref(), Some("A"), "{id}");
        a_granted += 1;
        assert!(
            a_granted <= 1,
            "B still waits after {a_granted} of A's grants"
        );
    }
    worker.stop().await;
    check_invariants(&conn).await.unwrap();
}

/// A small deterministic generator (the property below runs the same cases every time).
struct Lcg(u64);
impl Lcg {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        usize::try_from(self.0 >> 33).unwrap() % n
    }
}

/// Keyed semaphore `name` of `capacity`, all of it held by `{name}-hold` (granted first), so
/// that every request queued after is examined, and placed by key, before any is granted.
async fn keyed_and_held(
    client: &permitq::Client,
    conn: &tokio_postgres::Client,
    name: &str,
    capacity: i32,
) {
    keyed(client, name, capacity).await;
    client
        .submit(&Request::new(format!("{name}-hold")).permit(name, i64::from(capacity)))
        .await
        .unwrap();
    assert_eq!(next_grant_kept(conn, name).await, format!("{name}-hold"));
}

/// Request `{name}-k{key}-{index}` for `count` of `name`, under fairness key `k{key}` with
/// `weight`.
async fn submit_keyed(
    client: &permitq::Client,
    name: &str,
    (key, index): (usize, usize),
    count: i64,
    weight: i32,
) {
    client
        .submit(
            &Request::new(format!("{name}-k{key}-{index}"))
                .permit(name, count)
                .fairness_key(format!("k{key}"))
                .fairness_weight(weight),
        )
        .await
        .unwrap();
}

/// 2 to 4 keys of random weights (1 to 3), `per_key` requests each, arrivals interleaved at
/// random across keys, in order within each key: (keys, weights, (key, index) in arrival order).
fn random_backlog(rng: &mut Lcg, per_key: usize) -> (usize, Vec<i32>, Vec<(usize, usize)>) {
    let keys = 2 + rng.below(3);
    let weights: Vec<i32> = (0..keys)
        .map(|_| 1 + i32::try_from(rng.below(3)).unwrap())
        .collect();
    let mut next = vec![0; keys];
    let mut order = Vec::new();
    while order.len() < keys * per_key {
        let k = rng.below(keys);
        if next[k] < per_key {
            order.push((k, next[k]));
            next[k] += 1;
        }
    }
    (keys, weights, order)
}

/// Keys with random weights each submit a backlog at once, arrivals interleaved at random: in
/// every window of grants while every key waits, each key gets its weighted share within one
/// request (start-time fair queuing's bound, below), so no key is starved. Without keys the
/// line would be arrival order, and a window could hold one key alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_keys_are_served_in_proportion_to_their_weights() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let conn = db.conn().await;
    let worker = db.notified_worker("w1");
    for seed in 1..=4u64 {
        let mut rng = Lcg(seed);
        let name = format!("pool-{seed}");
        keyed_and_held(&client, &conn, &name, 1).await;
        let per_key = 30;
        let (keys, weights, order) = random_backlog(&mut rng, per_key);
        for (k, i) in &order {
            submit_keyed(&client, &name, (*k, *i), 1, weights[*k]).await;
        }
        wait_examined(&conn, &name, order.len()).await;
        client.release(&format!("{name}-hold")).await.unwrap();
        // While every key still waits: the first grants, until one key's backlog is done.
        let mut served: Vec<usize> = Vec::new();
        let mut left = vec![per_key; keys];
        while left.iter().all(|n| *n > 0) {
            let (_, key) = next_grant(&client, &conn, &name).await;
            let k: usize = key.unwrap()[1..].parse().unwrap();
            served.push(k);
            left[k] -= 1;
        }
        // Start-time fair queuing's bound: in any window, two waiting keys' grants, each
        // divided by its weight, differ by at most one request of each (1/w_i + 1/w_j).
        for start in 0..served.len() {
            let mut counts = vec![0i32; keys];
            for (n, k) in served[start..].iter().enumerate() {
                counts[*k] += 1;
                for i in 0..keys {
                    for j in 0..keys {
                        let (wi, wj) = (f64::from(weights[i]), f64::from(weights[j]));
                        let apart = f64::from(counts[i]) / wi - f64::from(counts[j]) / wj;
                        assert!(
                            apart <= 1.0 / wi + 1.0 / wj + 1e-9,
                            "seed {seed}, weights {weights:?}: in the {} grants from grant \
                             {start}, k{i} got {} and k{j} {}; served {served:?}",
                            n + 1,
                            counts[i],
                            counts[j]
                        );
                    }
                }
            }
        }
        // The rest drain.
        while left.iter().sum::<usize>() > 0 {
            let (_, key) = next_grant(&client, &conn, &name).await;
            let k: usize = key.unwrap()[1..].parse().unwrap();
            left[k] -= 1;
        }
    }
    worker.stop().await;
    check_invariants(&conn).await.unwrap();
    // Retention forgets the finish tags the virtual time has passed (they say nothing), and
    // only those.
    let count = |stale: bool| {
        let conn = &conn;
        async move {
            conn.query_one(
                "SELECT count(*) FROM permitq.key_finish f JOIN permitq.keyed_semaphore k
                 USING (semaphore_id)
                 WHERE (f.finish <= k.virtual_time AND f.placed_until < now()) = $1",
                &[&stale],
            )
            .await
            .unwrap()
            .get::<_, i64>(0)
        }
    };
    // (Their places are minutes ahead: as if those had passed.)
    conn.execute(
        "UPDATE permitq.key_finish SET placed_until = placed_until - interval '1 day'",
        &[],
    )
    .await
    .unwrap();
    let (stale, live) = (count(true).await, count(false).await);
    assert!(stale > 0, "keys that finished early left tags behind");
    conn.execute("SELECT permitq.delete_settled('1 hour', 1000)", &[])
        .await
        .unwrap();
    assert_eq!((count(true).await, count(false).await), (0, live));
}

/// Waits until a request holds `semaphore`, and leaves it held: the holder.
/// The line a keyed semaphore keeps, with counts: keys of random weights each queue a backlog
/// of requests for 1 to 3 permits, arrivals interleaved at random, behind a holder of the whole
/// capacity (every batch then waits, so each is placed by key). In the line (`waiters`, in
/// position order: the order the workers grant in) each key's requests keep their arrival
/// order, and in every stretch of the line where every key still has requests further on, two
/// keys' permits, each divided by its weight, differ by at most one largest request of each
/// (start-time fair queuing's bound with sizes: 3/w_i + 3/w_j).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_line_shares_permits_by_weight_whatever_the_counts() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let conn = db.conn().await;
    let worker = db.notified_worker("w1");
    for seed in 11..=14u64 {
        let mut rng = Lcg(seed);
        let name = format!("counts-{seed}");
        keyed_and_held(&client, &conn, &name, 3).await;
        let (keys, weights, arrivals) = random_backlog(&mut rng, 20);
        let order: Vec<(usize, usize, usize)> = arrivals
            .into_iter()
            .map(|(k, i)| (k, i, 1 + rng.below(3)))
            .collect();
        for (k, i, count) in &order {
            let count = i64::try_from(*count).unwrap();
            submit_keyed(&client, &name, (*k, *i), count, weights[*k]).await;
        }
        wait_examined(&conn, &name, order.len()).await;
        let mut line = client.waiters(&name, 1000).await.unwrap();
        line.sort_by_key(|w| w.position);
        assert_eq!(line.len(), order.len());
        // (key, index within the key, count), in line order.
        let placed: Vec<(usize, usize, i64)> = line
            .iter()
            .map(|w| {
                let rest = w.external_id.strip_prefix(&format!("{name}-k")).unwrap();
                let (k, i) = rest.split_once('-').unwrap();
                (k.parse().unwrap(), i.parse().unwrap(), w.count)
            })
            .collect();
        for k in 0..keys {
            let of_key: Vec<usize> = placed.iter().filter(|p| p.0 == k).map(|p| p.1).collect();
            assert!(
                of_key.windows(2).all(|w| w[0] < w[1]),
                "seed {seed}: k{k} out of arrival order: {of_key:?}"
            );
        }
        // Where every key still has requests further on in the line.
        let backlogged = (0..keys)
            .map(|k| placed.iter().rposition(|p| p.0 == k).unwrap())
            .min()
            .unwrap();
        for start in 0..backlogged {
            let mut permits = vec![0i64; keys];
            for (k, _, count) in &placed[start..backlogged] {
                permits[*k] += count;
                for i in 0..keys {
                    for j in 0..keys {
                        let (wi, wj) = (f64::from(weights[i]), f64::from(weights[j]));
                        #[allow(clippy::cast_precision_loss)]
                        let apart = permits[i] as f64 / wi - permits[j] as f64 / wj;
                        assert!(
                            apart <= 3.0 / wi + 3.0 / wj + 1e-9,
                            "seed {seed}, weights {weights:?}: from place {start}, k{i} has {} \
                             permits and k{j} {}; line {placed:?}",
                            permits[i],
                            permits[j]
                        );
                    }
                }
            }
        }
        client.release(&format!("{name}-hold")).await.unwrap();
    }
    worker.stop().await;
    check_invariants(&conn).await.unwrap();
}

async fn next_grant_kept(conn: &tokio_postgres::Client, semaphore: &str) -> String {
    held(conn, semaphore).await.swap_remove(0).0
}

/// Waits until `n` requests wait in `semaphore`'s line, examined.
async fn wait_examined(conn: &tokio_postgres::Client, semaphore: &str, n: usize) {
    common::wait_until(SOON, "every request examined", || async move {
        let waiting: i64 = conn
            .query_one(
                "SELECT count(*) FROM permitq.waiter w JOIN permitq.semaphore s
                 ON s.id = w.semaphore_id WHERE s.name = $1",
                &[&semaphore],
            )
            .await
            .unwrap()
            .get(0);
        usize::try_from(waiting).ok() == Some(n)
    })
    .await;
}

/// What `explain` says of request `id`'s fairness key on the first semaphore it names (empty
/// where it says nothing).
async fn fairness_line(client: &permitq::Client, id: &str) -> String {
    let explained = client.explain(id).await.unwrap().unwrap();
    explained.semaphores[0].fairness.clone().unwrap_or_default()
}

/// A key that had the semaphore to itself is not punished for it: once another key arrives,
/// the two alternate (the virtual time moved with what was granted), rather than the newcomer
/// taking every grant until it has had as many as the first key had alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_that_ran_alone_is_not_punished_for_it() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let conn = db.conn().await;
    keyed(&client, "api", 1).await;
    let worker = db.notified_worker("w1");
    // A alone: 20 grants, one at a time.
    for i in 0..20 {
        let id = format!("solo-{i}");
        client
            .submit(&Request::new(&id).permit("api", 1).fairness_key("A"))
            .await
            .unwrap();
        assert_eq!(next_grant(&client, &conn, "api").await.0, id);
    }
    // Then both wait, behind a holder.
    client
        .submit(&Request::new("holder").permit("api", 1))
        .await
        .unwrap();
    assert_eq!(next_grant_kept(&conn, "api").await, "holder");
    for i in 0..6 {
        for key in ["A", "B"] {
            client
                .submit(
                    &Request::new(format!("{key}-{i}"))
                        .permit("api", 1)
                        .fairness_key(key),
                )
                .await
                .unwrap();
        }
    }
    wait_examined(&conn, "api", 12).await;
    client.release("holder").await.unwrap();
    let mut served = String::new();
    for _ in 0..12 {
        served.push_str(&next_grant(&client, &conn, "api").await.1.unwrap());
    }
    assert!(
        served.contains("ABAB") || served.contains("BABA"),
        "A was held back for what it used alone: {served}"
    );
    let b_first_six = served[..6].matches('B').count();
    assert!(b_first_six <= 4, "{served}");
    worker.stop().await;
    check_invariants(&conn).await.unwrap();
}

/// With room to spare (capacity 4, holders releasing at once), a burst's requests that their key
/// placed further back take no room that requests not examined yet ahead of them need: B, behind
/// 2,000 of A's, is granted by the batch that examines it, and before that batch A's took at most
/// the capacity (the first, placed at its arrival, then what B's room left over); without keys,
/// or with backfill past B's room, they would take a share of every batch that examined them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_room_to_spare_a_burst_does_not_pass_a_request_not_yet_examined() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let conn = db.conn().await;
    keyed(&client, "pool", 4).await;
    queue_burst(&conn, "pool", "A", "a-", 2_000).await;
    client
        .submit(&Request::new("b-1").permit("pool", 1).fairness_key("B"))
        .await
        .unwrap();
    let worker = db.notified_worker("w1");
    let deadline = Instant::now() + SOON;
    loop {
        let holders = holders_on(&conn, "pool").await;
        if holders.iter().any(|(id, _)| id == "b-1") {
            break;
        }
        for (id, _) in &holders {
            client.release(id).await.unwrap();
        }
        assert!(Instant::now() < deadline, "b-1 not granted");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let before: Vec<String> = conn
        .query(
            "SELECT external_id FROM permitq.permit_request
             WHERE fairness_key = 'A' AND decided_at
                   < (SELECT decided_at FROM permitq.permit_request WHERE external_id = 'b-1')
               AND acquired_at IS NOT NULL ORDER BY id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert!(before.len() <= 4, "granted before b-1: {before:?}");
    let b: tokio_postgres::Row = conn
        .query_one(
            "SELECT examined_at = decided_at FROM permitq.permit_request
             WHERE external_id = 'b-1'",
            &[],
        )
        .await
        .unwrap();
    assert!(
        b.get::<_, bool>(0),
        "b-1 waited in line after it was examined"
    );
    worker.stop().await;
    check_invariants(&conn).await.unwrap();
}

/// Arrival order within a key holds even once the virtual time has passed the key's finish tag
/// (another key's requests granted past a waiter of this key that cannot be granted yet): the
/// key's next request is placed behind its waiting ones, not at its arrival ahead of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keys_requests_stay_in_arrival_order_when_the_virtual_time_passes_them() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let conn = db.conn().await;
    keyed(&client, "s", 3).await;
    client.set_capacity("u", 1, None).await.unwrap();
    let worker = db.notified_worker("w1");
    let granted = |id: &'static str| {
        let client = &client;
        async move {
            let r = client.wait_settled(id, SOON).await.unwrap().unwrap();
            assert_eq!(r.state, permitq::State::Acquired, "{id}");
        }
    };
    client
        .submit(&Request::new("hold-u").permit("u", 1))
        .await
        .unwrap();
    granted("hold-u").await;
    client
        .submit(&Request::new("a1").permit("s", 1).fairness_key("A"))
        .await
        .unwrap();
    granted("a1").await;
    // a2 waits: u is held. It is first in line on s, placed a turn after its arrival.
    client
        .submit(
            &Request::new("a2")
                .permit("s", 1)
                .permit("u", 1)
                .fairness_key("A"),
        )
        .await
        .unwrap();
    wait_examined(&conn, "u", 1).await;
    // B's requests are granted past it one at a time (leaving a2 its room on s), each a turn
    // further on, until the virtual time has passed A's finish tag.
    for id in ["b1", "b2", "b3", "b4"] {
        client
            .submit(&Request::new(id).permit("s", 1).fairness_key("B"))
            .await
            .unwrap();
        granted(id).await;
        client.release(id).await.unwrap();
    }
    let passed: bool = conn
        .query_one(
            "SELECT k.virtual_time > f.finish FROM permitq.keyed_semaphore k
             JOIN permitq.key_finish f USING (semaphore_id) WHERE f.fairness_key = 'A'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        passed,
        "the virtual time did not pass A's finish tag: no case"
    );
    // (Two permits: one would fit beside a2's room and be granted at once.)
    client
        .submit(&Request::new("a3").permit("s", 2).fairness_key("A"))
        .await
        .unwrap();
    common::wait_until(SOON, "a3 examined", || async {
        client
            .status("a3")
            .await
            .unwrap()
            .is_some_and(|r| r.examined_at.is_some())
    })
    .await;
    let line: Vec<String> = client
        .waiters("s", 10)
        .await
        .unwrap()
        .into_iter()
        .map(|w| w.external_id)
        .collect();
    assert_eq!(line, ["a2", "a3"], "A's requests in arrival order");
    worker.stop().await;
    check_invariants(&conn).await.unwrap();
}

/// Placing a batch reads each of its keys' finish tags by key, never all of them, even with a
/// plan made while the table was new, empty and vacuumed (a worker's first batch on the first
/// keyed semaphore; the plan is kept for the session) and thousands of tags in it now: the
/// batch's reads of key_finish, from this transaction's own counters, stay near one per request
/// (planted: the plain join, which such a plan read whole and then scanned for every request:
/// 65 ms a batch of 100 over 10,000 keys, against 3).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_reads_its_keys_finish_tags_by_key_whatever_the_plan_was_made_on() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let conn = db.conn().await;
    keyed(&client, "pool", 1_000_000).await;
    keyed(&client, "other", 1).await;
    // A new install's empty table, vacuumed (`vacuumdb --analyze` after setting up, say).
    conn.batch_execute("TRUNCATE permitq.key_finish")
        .await
        .unwrap();
    conn.batch_execute("VACUUM ANALYZE permitq.key_finish")
        .await
        .unwrap();
    conn.execute(
        "INSERT INTO permitq.permit_request (external_id, permits, fairness_key)
         SELECT 'r' || i, '{\"pool\": 1}', 'tenant-' || i FROM generate_series(1, 101) i",
        &[],
    )
    .await
    .unwrap();
    let worker_session = db.conn().await;
    let place = |ids: &'static str| {
        format!(
            "SELECT cardinality(permitq.place_by_keys(array_agg(id ORDER BY id),
                                                      array_agg(-id ORDER BY id)))::int8
             FROM permitq.permit_request WHERE external_id {ids}"
        )
    };
    // Its first batch, on the empty table: the plan it keeps.
    worker_session.batch_execute("BEGIN").await.unwrap();
    worker_session
        .query_one(&place("= 'r101'"), &[])
        .await
        .unwrap();
    worker_session.batch_execute("ROLLBACK").await.unwrap();
    conn.batch_execute(
        "INSERT INTO permitq.key_finish (semaphore_id, fairness_key, finish, placed_until)
         SELECT s.id, 'old-' || i, now(), now()
         FROM permitq.semaphore s, generate_series(1, 5000) i WHERE s.name = 'other'",
    )
    .await
    .unwrap();
    worker_session.batch_execute("BEGIN").await.unwrap();
    let placed: i64 = worker_session
        .query_one(&place("<> 'r101'"), &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(placed, 100);
    let read: i64 = worker_session
        .query_one(
            "SELECT pg_stat_get_xact_tuples_returned('permitq.key_finish_pkey'::regclass)
                  + pg_stat_get_xact_tuples_returned('permitq.key_finish'::regclass)",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    worker_session.batch_execute("ROLLBACK").await.unwrap();
    assert!(
        read <= 300,
        "placing 100 requests read {read} finish tags (the table holds 5,000): all of them, scanned again for every request"
    );
}

/// Turns count while requests wait in line: a backlog of one request per key that fits whole is
/// granted at once and moves no key's finish tag nor the virtual time (placing would move none
/// of them, and the decision on arrival order left nothing waiting); a batch that does not fit
/// is placed by key, and its key's finish tag moves (planted: placing by key every batch, or
/// never, fails one half). The rule is per batch: a batch in which anything waits or would move
/// is placed whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_that_fits_whole_is_placed_by_no_key_and_one_that_waits_is() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let conn = db.conn().await;
    keyed(&client, "roomy", 1_000).await;
    keyed(&client, "tight", 2).await;
    let tags = |semaphore: &'static str| {
        let conn = &conn;
        async move {
            let row = conn
                .query_one(
                    "SELECT (SELECT count(*) FROM permitq.key_finish f
                             WHERE f.semaphore_id = s.id),
                            k.virtual_time
                     FROM permitq.semaphore s JOIN permitq.keyed_semaphore k
                       ON k.semaphore_id = s.id WHERE s.name = $1",
                    &[&semaphore],
                )
                .await
                .unwrap();
            (row.get::<_, i64>(0), row.get::<_, std::time::SystemTime>(1))
        }
    };
    let (_, roomy_v) = tags("roomy").await;
    // One batch each (a batch is placed whole or not at all): the roomy burst first, a request
    // of each of 50 keys (a key's second request in a batch would go back a turn: placed).
    conn.execute(
        "INSERT INTO permitq.permit_request (external_id, permits, fairness_key)
         SELECT 'a-' || i, '{\"roomy\": 1}', 'tenant-' || i FROM generate_series(1, 50) i",
        &[],
    )
    .await
    .unwrap();
    let worker = db.notified_worker("w1");
    let deadline = Instant::now() + SOON;
    while holders_on(&conn, "roomy").await.len() < 50 {
        assert!(Instant::now() < deadline, "the roomy burst was not granted");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    queue_burst(&conn, "tight", "A", "t-", 5).await;
    while holders_on(&conn, "tight").await.len() < 2 {
        assert!(Instant::now() < deadline, "the tight burst was not granted");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    worker.stop().await;
    assert_eq!(
        tags("roomy").await,
        (0, roomy_v),
        "a backlog that fit whole moved a finish tag or the virtual time"
    );
    let (tight_keys, _) = tags("tight").await;
    assert_eq!(
        tight_keys, 1,
        "the batch that waited was not placed by key A"
    );
    check_invariants(&conn).await.unwrap();
}

/// A burst that would fit whole (capacity 100, a batch of 100) is still placed by key: its
/// requests after the first go back behind B, which arrived right after it, and B is granted
/// without waiting for A's releases (found in review: a first version granted such a batch whole
/// on arrival order, and B waited behind A's 100 held permits).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_that_fits_whole_still_leaves_a_newcomer_its_turn() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let conn = db.conn().await;
    keyed(&client, "pool", 100).await;
    queue_burst(&conn, "pool", "A", "a-", 100).await;
    client
        .submit(&Request::new("b-1").permit("pool", 1).fairness_key("B"))
        .await
        .unwrap();
    let worker = db.notified_worker("w1");
    common::wait_until(SOON, "b-1 examined", || async {
        client
            .status("b-1")
            .await
            .unwrap()
            .is_some_and(|r| r.examined_at.is_some())
    })
    .await;
    let r = client.status("b-1").await.unwrap().unwrap();
    let a_held = holders_on(&conn, "pool").await.len();
    worker.stop().await;
    assert_eq!(
        r.state,
        permitq::State::Acquired,
        "b-1 waits behind A's burst; A holds {a_held}"
    );
    check_invariants(&conn).await.unwrap();
}

/// The same burst, decided on the worker's stepwise path (a data error in the one-call claim
/// makes the worker claim again a step at a time): the batch is ranked by the places its keys
/// give it there too, and B is granted without waiting for A's releases. (Planted: the stepwise
/// lock placing the batch by key itself, while the worker ranked it by arrival, granted A's 100.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_claimed_stepwise_is_ranked_by_key_too() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let conn = db.conn().await;
    keyed(&client, "pool", 100).await;
    // A release pending, so that the batch's lock folds it: an UPDATE of the semaphore row,
    // which fails once, in the one-call claim (permitq.next_batch) only: a failure there leaves
    // the worker nothing claimed, and it claims again a step at a time. (A sequence counts
    // outside the transaction that fails.)
    client
        .submit(&Request::new("h").permit("pool", 1).fairness_key("H"))
        .await
        .unwrap();
    let worker = db.notified_worker("w0");
    assert_eq!(
        client.wait_settled("h", SOON).await.unwrap().unwrap().state,
        permitq::State::Acquired
    );
    worker.stop().await;
    queue_burst(&conn, "pool", "A", "a-", 100).await;
    client
        .submit(&Request::new("b-1").permit("pool", 1).fairness_key("B"))
        .await
        .unwrap();
    client.release("h").await.unwrap();
    conn.batch_execute(
        "CREATE SEQUENCE public.fold_tries;
         CREATE SEQUENCE public.stepwise_folds;
         CREATE FUNCTION public.fail_first_fold() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF current_query() LIKE '%permitq.next_batch(%' THEN
                 IF nextval('public.fold_tries') = 1 THEN
                     RAISE EXCEPTION 'planted: the first fold fails' USING ERRCODE = '22008';
                 END IF;
             ELSIF current_query() LIKE '%permitq.lock_batch_and_heads(%' THEN
                 PERFORM nextval('public.stepwise_folds');
             END IF;
             RETURN NEW;
         END $$;
         CREATE TRIGGER fail_first_fold BEFORE UPDATE ON permitq.semaphore
             FOR EACH ROW EXECUTE FUNCTION public.fail_first_fold();",
    )
    .await
    .unwrap();
    let worker = db.notified_worker("w1");
    // Until b-1 is granted or nothing is left unexamined (what the batch decided is final).
    common::wait_until(SOON, "b-1 granted or every request examined", || async {
        let granted = client
            .status("b-1")
            .await
            .unwrap()
            .is_some_and(|r| r.state == permitq::State::Acquired);
        granted || common::unexamined_requests(&conn).await == 0
    })
    .await;
    let r = client.status("b-1").await.unwrap().unwrap();
    let a_held = holders_on(&conn, "pool").await.len();
    worker.stop().await;
    let row = conn
        .query_one(
            "SELECT (SELECT is_called FROM public.fold_tries),
                    (SELECT is_called FROM public.stepwise_folds)",
            &[],
        )
        .await
        .unwrap();
    let (failed, stepwise): (bool, bool) = (row.get(0), row.get(1));
    assert!(
        failed && stepwise,
        "the one-call claim failed: {failed}; a stepwise lock folded: {stepwise}"
    );
    assert_eq!(
        r.state,
        permitq::State::Acquired,
        "b-1 waits behind A's burst; A holds {a_held}"
    );
    conn.batch_execute("DROP TRIGGER fail_first_fold ON permitq.semaphore")
        .await
        .unwrap();
    check_invariants(&conn).await.unwrap();
}

/// A key whose finish tag is ahead of the virtual time (it was served a lot while others
/// waited) has its next request placed back even alone in a batch that fits: B, arriving right
/// after it and not examined yet, is ahead of it and keeps the room (batches of one request;
/// planted: deciding "placing moves no request" from the batch's duplicate keys alone, without
/// the finish tags, grants A's first).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_ahead_of_the_virtual_time_is_placed_back_even_alone_in_a_batch() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let conn = db.conn().await;
    keyed(&client, "pool", 1).await;
    conn.execute(
        "INSERT INTO permitq.key_finish (semaphore_id, fairness_key, finish, placed_until)
         SELECT id, 'A', now() + interval '1 hour', now() - interval '1 hour'
         FROM permitq.semaphore WHERE name = 'pool'",
        &[],
    )
    .await
    .unwrap();
    for (id, key) in [("a-1", "A"), ("b-1", "B")] {
        client
            .submit(&Request::new(id).permit("pool", 1).fairness_key(key))
            .await
            .unwrap();
    }
    let mut config = common::quiet_config("w1");
    config.batch_size = 1;
    let worker = db.worker(config);
    let (first, _) = next_grant(&client, &conn, "pool").await;
    worker.stop().await;
    assert_eq!(first, "b-1", "A's request, placed an hour back, went first");
}

/// A request that stops waiting keeps the turn its key took: a cancel and a timeout each say so
/// in the request's `error_detail` (`turn_kept_on`) and outcome, and the key's next request is
/// placed behind that turn. One cancelled before a worker placed it took no turn, and says none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_or_timeout_keeps_its_keys_turn_and_says_so() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let conn = db.conn().await;
    keyed(&client, "gpu", 1).await;
    client.set_capacity("plain", 1, Some(true)).await.unwrap();
    // Cancelled before any worker ran: no turn taken.
    client
        .submit(&Request::new("early").permit("gpu", 1).fairness_key("A"))
        .await
        .unwrap();
    client.release("early").await.unwrap();
    let early = client.status("early").await.unwrap().unwrap();
    assert!(
        early
            .error_detail
            .as_ref()
            .is_none_or(|d| d.turn_kept_on.is_empty()),
        "{early:?}"
    );
    let worker = db.notified_worker("w1");
    client
        .submit(&Request::new("holder").permit("gpu", 1).permit("plain", 1))
        .await
        .unwrap();
    assert_eq!(next_grant_kept(&conn, "gpu").await, "holder");
    for (id, wait) in [("a-1", None), ("a-2", Some(Duration::from_secs(2)))] {
        let mut request = Request::new(id).permit("gpu", 1).fairness_key("A");
        request.wait = wait;
        client.submit(&request).await.unwrap();
    }
    client
        .submit(&Request::new("p-1").permit("plain", 1))
        .await
        .unwrap();
    wait_examined(&conn, "gpu", 2).await;
    wait_examined(&conn, "plain", 1).await;
    assert_eq!(
        client.release("a-1").await.unwrap(),
        permitq::ReleaseOutcome::Cancelled
    );
    client.release("p-1").await.unwrap();
    let settled = client
        .wait_settled("a-2", Duration::from_secs(20))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        settled.error_code.map(|c| c.to_string()).as_deref(),
        Some("timeout")
    );
    for (id, code) in [("a-1", "cancelled"), ("a-2", "timeout")] {
        let row = client.status(id).await.unwrap().unwrap();
        let detail = row.error_detail.clone().unwrap_or_default();
        assert_eq!(detail.turn_kept_on, ["gpu"], "{id}: {row:?}");
        let outcome = row.outcome().unwrap();
        assert!(
            outcome.starts_with(&format!("error {code}"))
                && outcome.contains(
                    "its turn on gpu stays taken for its fairness key A until the line passes \
                     it, so the key's next request there is placed behind it"
                ),
            "{outcome}"
        );
    }
    // On a semaphore not served by key, a cancel keeps no turn.
    let plain = client.status("p-1").await.unwrap().unwrap();
    assert!(
        plain
            .error_detail
            .as_ref()
            .is_none_or(|d| d.turn_kept_on.is_empty()),
        "{plain:?}"
    );
    // Nothing of A waits or holds, yet its turns are outstanding: its share says so.
    let shares = client.key_shares("gpu").await.unwrap();
    let a = shares
        .iter()
        .find(|k| k.fairness_key == "A")
        .unwrap_or_else(|| panic!("A not listed: {shares:?}"));
    assert!(
        a.waiting == 0
            && a.held == 0
            && a.placed_back
                .is_some_and(|back| back > Duration::from_secs(15)),
        "{a:?}"
    );
    // The key's next request is placed behind both turns.
    client
        .submit(&Request::new("a-3").permit("gpu", 1).fairness_key("A"))
        .await
        .unwrap();
    wait_examined(&conn, "gpu", 1).await;
    let fairness = fairness_line(&client, "a-3").await;
    assert!(
        fairness.contains("placed 20s after its arrival, by its key's turns that the line had")
            && fairness.contains(
                "None of its key's requests that took their turns before it still waits here: \
                 the turns are of its key's requests already granted or ended"
            ),
        "{fairness}"
    );
    worker.stop().await;
    check_invariants(&conn).await.unwrap();
}

/// A template served by key: its instances are, those it has and those made later, each a line
/// of its own; turning its keys off turns theirs off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_templates_instances_are_served_by_key_when_it_is() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let conn = db.conn().await;
    client.set_capacity("lab-*", 1, Some(true)).await.unwrap();
    let worker = db.notified_worker("w1");
    client
        .submit(&Request::new("old-1").permit("lab-old", 1))
        .await
        .unwrap();
    assert_eq!(next_grant_kept(&conn, "lab-old").await, "old-1");
    keyed(&client, "lab-*", 1).await;
    client
        .submit(&Request::new("new-1").permit("lab-new", 1).fairness_key("A"))
        .await
        .unwrap();
    assert_eq!(next_grant_kept(&conn, "lab-new").await, "new-1");
    let keyed_now = |usage: Vec<permitq::SemaphoreUsage>| -> Vec<(String, bool)> {
        usage
            .into_iter()
            .map(|u| (u.name, u.fairness_keys))
            .collect()
    };
    assert_eq!(
        keyed_now(client.usage().await.unwrap()),
        [
            ("lab-*".to_string(), true),
            ("lab-new".to_string(), true),
            ("lab-old".to_string(), true)
        ]
    );
    // Each instance is its own line: key A's request on lab-new is not placed behind its turns
    // on lab-old.
    for id in ["old-2", "old-3"] {
        client
            .submit(&Request::new(id).permit("lab-old", 1).fairness_key("A"))
            .await
            .unwrap();
    }
    client
        .submit(&Request::new("new-2").permit("lab-new", 1).fairness_key("A"))
        .await
        .unwrap();
    wait_examined(&conn, "lab-old", 2).await;
    wait_examined(&conn, "lab-new", 1).await;
    // The instance made before the switch is keyed: old-3 is placed a turn behind old-2. The
    // one made after it is too, and a line of its own: new-2 is not behind key A's turns on
    // lab-old.
    let said = fairness_line(&client, "old-3").await;
    assert!(said.contains("placed 10s after its arrival"), "{said}");
    let said = fairness_line(&client, "new-2").await;
    assert!(said.contains("placed at its arrival"), "{said}");
    client
        .set_semaphore("lab-*", 1, &SemaphoreSettings::new().fairness_keys(false))
        .await
        .unwrap();
    assert!(client
        .usage()
        .await
        .unwrap()
        .iter()
        .all(|u| !u.fairness_keys));
    for id in ["old-1", "new-1"] {
        client.release(id).await.unwrap();
    }
    worker.stop().await;
    check_invariants(&conn).await.unwrap();
}

/// A key is not a login's own: a producer that names another tenant's key learns nothing of that
/// tenant's requests. Its `explain` lists only its own requests among its key's, and its
/// `key_shares` says nothing of how far back the key's turns reach; an admin sees both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_sharing_a_key_reads_nothing_of_the_other_logins_requests() {
    let db = TestDb::new().await;
    let admin = db.client().await;
    let conn = db.conn().await;
    keyed(&admin, "gpu", 1).await;
    let worker = db.notified_worker("w1");
    admin
        .submit(&Request::new("holder").permit("gpu", 1))
        .await
        .unwrap();
    assert_eq!(next_grant_kept(&conn, "gpu").await, "holder");
    let alice = permitq::Client::connect(&db.login("permitq_producer").await)
        .await
        .unwrap();
    for id in ["alice-1", "alice-2"] {
        alice
            .submit(&Request::new(id).permit("gpu", 1).fairness_key("acme"))
            .await
            .unwrap();
    }
    let user = format!("mallory_keys_{}", std::process::id());
    conn.batch_execute(&format!(
        "CREATE ROLE {user} LOGIN PASSWORD 'pw' IN ROLE permitq_producer"
    ))
    .await
    .unwrap();
    let mallory = permitq::Client::connect(&common::as_user(&db.url, &user, "pw"))
        .await
        .unwrap();
    mallory
        .submit(&Request::new("m-1").permit("gpu", 1).fairness_key("acme"))
        .await
        .unwrap();
    wait_examined(&conn, "gpu", 3).await;
    let said = fairness_line(&mallory, "m-1").await;
    assert!(
        said.contains("placed 20s after its arrival")
            && said.contains(
                "None of yours with its key that took their turns before it still waits here \
                 (other logins' requests are not listed)"
            )
            && !said.contains("alice")
            && !said.contains("another login's request"),
        "{said}"
    );
    // Its own key alone, with no share (a share among its own keys would mislead) and no
    // placed_back (it would count alice's turns).
    let shares = mallory.key_shares("gpu").await.unwrap();
    assert!(
        shares.len() == 1
            && shares[0].fairness_key == "acme"
            && shares[0].waiting == 1
            && shares[0].share_percent.is_none()
            && shares[0].placed_back.is_none(),
        "{shares:?}"
    );
    let seen = fairness_line(&admin, "m-1").await;
    assert!(
        seen.contains("Its key's requests that took their turns before it and still wait here: alice-1, alice-2 ("),
        "{seen}"
    );
    assert!(admin
        .key_shares("gpu")
        .await
        .unwrap()
        .iter()
        .any(|k| k.fairness_key == "acme" && k.placed_back.is_some()),);
    // A key of weight 2: its turns are half as long; once its requests end, it is listed for its
    // turns alone, to the admin and not to the producer that never named it.
    for id in ["zeta-1", "zeta-2"] {
        alice
            .submit(
                &Request::new(id)
                    .permit("gpu", 1)
                    .fairness_key("zeta")
                    .fairness_weight(2),
            )
            .await
            .unwrap();
    }
    wait_examined(&conn, "gpu", 5).await;
    let seen = fairness_line(&admin, "zeta-2").await;
    assert!(
        seen.contains("still wait here: zeta-1 (their turns: 5s)"),
        "{seen}"
    );
    for id in ["zeta-1", "zeta-2"] {
        alice.release(id).await.unwrap();
    }
    let turns_alone = |shares: &[permitq::KeyShare]| {
        shares.iter().any(|k| {
            k.fairness_key == "zeta" && k.waiting == 0 && k.held == 0 && k.placed_back.is_some()
        })
    };
    let shares = admin.key_shares("gpu").await.unwrap();
    assert!(turns_alone(&shares), "{shares:?}");
    let shares = mallory.key_shares("gpu").await.unwrap();
    assert!(
        shares.iter().all(|k| k.fairness_key != "zeta"),
        "{shares:?}"
    );
    drop(mallory);
    admin.release("holder").await.unwrap();
    worker.stop().await;
    conn.batch_execute(&format!("DROP OWNED BY {user}; DROP ROLE {user}"))
        .await
        .unwrap();
}

/// A request that the batch first examining it fails at once, its wait already over or its
/// count above the capacity, never waited in line and takes no turn: its key's next request is
/// placed at its arrival, not behind turns nobody waited for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_failed_when_first_examined_takes_no_turn() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let conn = db.conn().await;
    keyed(&client, "gpu", 2).await;
    let mut late = Request::new("a-1").permit("gpu", 1).fairness_key("A");
    late.wait = Some(Duration::from_millis(200));
    client.submit(&late).await.unwrap();
    client
        .submit(&Request::new("a-2").permit("gpu", 3).fairness_key("A"))
        .await
        .unwrap();
    // No worker yet: a-1's wait runs out before any batch examines it. (The new worker's first
    // deadline sweep may end it before its first batch does: then it was never placed either.
    // a-2 is always failed by a batch, and without the rule its 30s turn would place a-3 back.)
    common::wait_until(SOON, "a-1's wait over", || async {
        conn.query_one(
            "SELECT wait_until < now() FROM permitq.permit_request WHERE external_id = 'a-1'",
            &[],
        )
        .await
        .unwrap()
        .get::<_, bool>(0)
    })
    .await;
    let worker = db.notified_worker("w1");
    for (id, code) in [("a-1", "timeout"), ("a-2", "exceeds_capacity")] {
        let row = client.wait_settled(id, SOON).await.unwrap().unwrap();
        assert_eq!(
            row.error_code.map(|c| c.to_string()).as_deref(),
            Some(code),
            "{row:?}"
        );
        assert!(
            row.error_detail
                .as_ref()
                .is_none_or(|d| d.turn_kept_on.is_empty()),
            "{row:?}"
        );
    }
    client
        .submit(&Request::new("holder").permit("gpu", 2))
        .await
        .unwrap();
    assert_eq!(next_grant_kept(&conn, "gpu").await, "holder");
    client
        .submit(&Request::new("a-3").permit("gpu", 1).fairness_key("A"))
        .await
        .unwrap();
    wait_examined(&conn, "gpu", 1).await;
    let said = fairness_line(&client, "a-3").await;
    assert!(said.contains("placed at its arrival"), "{said}");
    client.release("holder").await.unwrap();
    worker.stop().await;
    check_invariants(&conn).await.unwrap();
}

/// A malformed stored row (written around the checks) beside keyed requests fails alone as
/// `invalid`: placing the batch by key reads only the batch's own rows, and reads their permits
/// defensively, so the valid requests are granted as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_row_beside_keyed_requests_fails_alone() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let conn = db.conn().await;
    keyed(&client, "gpu", 5).await;
    conn.batch_execute(
        r#"SET session_replication_role = replica;
        INSERT INTO permitq.permit_request (external_id, permits, fairness_key) VALUES
            ('bad-array', '[1, 2]', 'A'),
            ('bad-count', '{"gpu": "x"}', 'A');
        SET session_replication_role = DEFAULT;"#,
    )
    .await
    .unwrap();
    for i in 1..=5 {
        client
            .submit(
                &Request::new(format!("g-{i}"))
                    .permit("gpu", 1)
                    .fairness_key("A"),
            )
            .await
            .unwrap();
    }
    let worker = db.notified_worker("w1");
    for i in 1..=5 {
        let row = client
            .wait_settled(&format!("g-{i}"), SOON)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(row.state, permitq::State::Acquired, "{row:?}");
    }
    for id in ["bad-array", "bad-count"] {
        let row = client.wait_settled(id, SOON).await.unwrap().unwrap();
        assert_eq!(
            row.error_code.map(|c| c.to_string()).as_deref(),
            Some("invalid"),
            "{row:?}"
        );
    }
    for i in 1..=5 {
        client.release(&format!("g-{i}")).await.unwrap();
    }
    worker.stop().await;
    check_invariants(&conn).await.unwrap();
}

/// A fail-fast try (wait 0) is placed like any other: granted, its turn counts; refused, it keeps
/// its turn, as a cancel does, and says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fail_fast_try_takes_its_turn_and_a_refused_one_says_so() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let conn = db.conn().await;
    keyed(&client, "gpu", 2).await;
    let worker = db.notified_worker("w1");
    client
        .submit(&Request::new("holder").permit("gpu", 1))
        .await
        .unwrap();
    assert_eq!(next_grant_kept(&conn, "gpu").await, "holder");
    // One batch: a-ff fits in its place (first) and is granted while b-1 waits, so the batch is
    // placed by key and a-ff's turn counts.
    conn.batch_execute(
        r#"INSERT INTO permitq.permit_request (external_id, permits, fairness_key, wait) VALUES
            ('a-ff', '{"gpu": 1}', 'A', '0s'), ('b-1', '{"gpu": 2}', 'B', NULL)"#,
    )
    .await
    .unwrap();
    let granted = client.wait_settled("a-ff", SOON).await.unwrap().unwrap();
    assert_eq!(granted.state, permitq::State::Acquired, "{granted:?}");
    wait_examined(&conn, "gpu", 1).await;
    client
        .submit(&Request::new("a-2").permit("gpu", 1).fairness_key("A"))
        .await
        .unwrap();
    wait_examined(&conn, "gpu", 2).await;
    let said = fairness_line(&client, "a-2").await;
    assert!(said.contains("placed 10s after its arrival"), "{said}");
    // A refused try keeps its turn, and says so.
    let mut try_now = Request::new("a-try").permit("gpu", 1).fairness_key("A");
    try_now.wait = Some(Duration::ZERO);
    client.submit(&try_now).await.unwrap();
    let row = client.wait_settled("a-try", SOON).await.unwrap().unwrap();
    assert_eq!(
        row.error_code.map(|c| c.to_string()).as_deref(),
        Some("no_capacity"),
        "{row:?}"
    );
    assert_eq!(
        row.error_detail.clone().unwrap_or_default().turn_kept_on,
        ["gpu"],
        "{row:?}"
    );
    let outcome = row.outcome().unwrap();
    assert!(
        outcome.contains(
            "with a longer --wait to queue; its turn on gpu stays taken for its \
                          fairness key A until the line passes it"
        ),
        "{outcome}"
    );
    // a-3 goes behind a-ff's, a-2's and the refused try's turns.
    client
        .submit(&Request::new("a-3").permit("gpu", 1).fairness_key("A"))
        .await
        .unwrap();
    wait_examined(&conn, "gpu", 3).await;
    let said = fairness_line(&client, "a-3").await;
    assert!(said.contains("placed 30s after its arrival"), "{said}");
    worker.stop().await;
    check_invariants(&conn).await.unwrap();
}

/// A keyed parent orders by key only the requests that name it: `explain`'s row for it, reached
/// through a child, says the line there takes the request at the place its child gave it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_parent_reached_through_a_child_says_it_did_not_place_it() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let conn = db.conn().await;
    keyed(&client, "pool", 1).await;
    client
        .set_semaphore("team", 1, &SemaphoreSettings::new().parent("pool"))
        .await
        .unwrap();
    let worker = db.notified_worker("w1");
    client
        .submit(&Request::new("holder").permit("pool", 1))
        .await
        .unwrap();
    assert_eq!(next_grant_kept(&conn, "pool").await, "holder");
    client
        .submit(&Request::new("t-1").permit("team", 1).fairness_key("A"))
        .await
        .unwrap();
    wait_examined(&conn, "team", 1).await;
    let explained = client.explain("t-1").await.unwrap().unwrap();
    let parent = explained
        .semaphores
        .iter()
        .find(|s| s.semaphore == "pool")
        .unwrap_or_else(|| panic!("no row for pool: {explained:?}"));
    let said = parent.fairness.clone().unwrap_or_default();
    assert!(
        said.starts_with(
            "fairness key A, weight 1: this line takes it through the semaphore it names below \
             pool, at the place the semaphores it names gave it (at its arrival): keys order \
             here only the requests that name pool itself."
        ),
        "{explained:?}"
    );
    client.release("holder").await.unwrap();
    worker.stop().await;
    check_invariants(&conn).await.unwrap();
}

/// A request placed at its arrival still hears where its priority puts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_placed_at_its_arrival_hears_where_its_priority_puts_it() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let conn = db.conn().await;
    keyed(&client, "gpu", 1).await;
    let worker = db.notified_worker("w1");
    client
        .submit(&Request::new("holder").permit("gpu", 1))
        .await
        .unwrap();
    assert_eq!(next_grant_kept(&conn, "gpu").await, "holder");
    let mut low = Request::new("g-1").permit("gpu", 1);
    low.priority = -2;
    client.submit(&low).await.unwrap();
    wait_examined(&conn, "gpu", 1).await;
    let said = fairness_line(&client, "g-1").await;
    assert!(
        said.contains(
            "placed at its arrival: when a worker examined it, no turn of its key was ahead of the \
             line (requests granted while nobody waited take no turn). With its priority -2 (2 \
             turns, 20s, later) it stands 20s after its arrival."
        ),
        "{said}"
    );
    client.release("holder").await.unwrap();
    worker.stop().await;
    check_invariants(&conn).await.unwrap();
}

/// Safe backfill keeps its meaning in a keyed line: the first in line (by key order) keeps its
/// count free, so a later, smaller request of another key that would fit the room left waits
/// too; both are granted once the room covers them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_first_in_line_keeps_its_room_from_a_smaller_later_key() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let conn = db.conn().await;
    let worker = db.notified_worker("w1");
    keyed(&client, "bf", 3).await;
    client
        .submit(&Request::new("bf-hold").permit("bf", 2))
        .await
        .unwrap();
    assert_eq!(next_grant_kept(&conn, "bf").await, "bf-hold");
    for (id, count, key) in [("bf-a1", 2, "a"), ("bf-b1", 1, "b")] {
        client
            .submit(&Request::new(id).permit("bf", count).fairness_key(key))
            .await
            .unwrap();
    }
    // Both examined and left waiting: b1 fits the one permit free, but would leave a1 less
    // than its 2.
    wait_examined(&conn, "bf", 2).await;
    let mut line = client.waiters("bf", 10).await.unwrap();
    line.sort_by_key(|w| w.position);
    let ids: Vec<&str> = line.iter().map(|w| w.external_id.as_str()).collect();
    assert_eq!(ids, ["bf-a1", "bf-b1"]);
    for id in ["bf-a1", "bf-b1"] {
        assert_eq!(
            client.status(id).await.unwrap().unwrap().state,
            permitq::State::New,
            "{id}"
        );
    }
    // Room for both: both go (b1 may go first: with 3 free, it leaves a1 its 2).
    client.release("bf-hold").await.unwrap();
    for id in ["bf-a1", "bf-b1"] {
        let r = client.wait_settled(id, SOON).await.unwrap().unwrap();
        assert_eq!(r.state, permitq::State::Acquired, "{id}: {r:?}");
    }
    worker.stop().await;
    check_invariants(&conn).await.unwrap();
}
