//! The database's final state after a chaos run, as the checkers read it.

use std::collections::{BTreeMap, HashMap};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::error::Result;

/// Microseconds since the epoch.
pub(crate) type Micros = i64;

pub(crate) fn us(t: SystemTime) -> Micros {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

/// A request row, as the checkers need it.
#[derive(Debug, Clone)]
pub(crate) struct Req {
    pub(crate) id: i64,
    pub(crate) external_id: String,
    pub(crate) permits: Vec<(String, i64)>,
    pub(crate) wait_us: Option<i64>,
    pub(crate) priority: i64,
    pub(crate) state: String,
    pub(crate) error_code: Option<String>,
    pub(crate) release_reason: Option<String>,
    pub(crate) created: Micros,
    pub(crate) acquired: Option<Micros>,
    pub(crate) settled: Option<Micros>,
    /// The worker that decided it.
    pub(crate) worker_id: Option<String>,
    /// When a worker first examined it.
    pub(crate) examined: Option<Micros>,
    /// When the worker transaction that granted or failed it began.
    pub(crate) decided: Option<Micros>,
    /// Its lease's end as last extended (TTL requests that were granted).
    pub(crate) expires: Option<Micros>,
    /// When it was released.
    pub(crate) released: Option<Micros>,
    /// Its fencing token, once granted.
    pub(crate) token: Option<i64>,
}

impl Req {
    /// Its place in line (the worker's rule: priority plus one per aging step waited, which
    /// orders requests by `priority × step − created` at every instant; then the lower id):
    /// greater is further ahead.
    pub(crate) fn rank(&self) -> (i64, i64) {
        let step = i64::try_from(permitq::AGING_STEP.as_micros()).unwrap_or(i64::MAX);
        (self.priority * step - self.created, -self.id)
    }

    /// When it stopped waiting (granted, failed or cancelled), if it did.
    pub(crate) fn left(&self) -> Option<Micros> {
        match (self.acquired, self.settled) {
            (Some(a), Some(s)) => Some(a.min(s)),
            (a, s) => a.or(s),
        }
    }

    /// Its count on `semaphore` (0 if it does not name it).
    pub(crate) fn count_on(&self, semaphore: &str) -> i64 {
        self.permits
            .iter()
            .find(|(n, _)| n == semaphore)
            .map_or(0, |p| p.1)
    }
}

/// Everything the checkers read from the database.
pub(crate) struct FinalState {
    pub(crate) requests: Vec<Req>,
    /// (request id, semaphore, count, acquired, released, fencing token): one row per
    /// semaphore a granted request took from, those it names and their ancestors, worked out
    /// here from what it named and the tree ([`Tree`]), not read from what permitq recorded.
    pub(crate) permits: Vec<(i64, String, i64, Micros, Option<Micros>, i64)>,
    /// The semaphores' parents.
    pub(crate) tree: Tree,
    /// semaphore → [(changed_at, capacity)], oldest first
    pub(crate) capacity: HashMap<String, Vec<(Micros, i64)>>,
    /// (name, used, fair)
    pub(crate) semaphores: Vec<(String, i64, bool)>,
    /// Rate-limited semaphore → its window.
    pub(crate) windows: HashMap<String, Micros>,
    /// Semaphore → its `granted` counter.
    pub(crate) granted_counter: HashMap<String, i64>,
    /// The semaphores served by fairness key.
    pub(crate) keyed: std::collections::HashSet<String>,
}

/// The nesting of the semaphores: each one's parent, and the templates' (an instance the idle
/// sweep removed had its template's).
#[derive(Debug, Default)]
pub(crate) struct Tree {
    parents: HashMap<String, String>,
    /// (template prefix, its parent)
    templates: Vec<(String, Option<String>)>,
    /// Each semaphore's guarantee in its parent, and each template's prefix's.
    guarantees: HashMap<String, i64>,
}

impl Tree {
    /// The semaphores' parents as the database has them now (the load never changes them).
    pub(crate) async fn load(conn: &tokio_postgres::Client) -> Result<Tree> {
        let mut tree = Tree::default();
        for r in conn
            .query(
                "SELECT name, parent, is_template, guarantee::int8 FROM permitq.semaphore",
                &[],
            )
            .await?
        {
            let (name, parent, template): (String, Option<String>, bool) =
                (r.get(0), r.get(1), r.get(2));
            let guarantee: i64 = r.get(3);
            if guarantee > 0 {
                let key = if template {
                    name.trim_end_matches('*').to_string()
                } else {
                    name.clone()
                };
                tree.guarantees.insert(key, guarantee);
            }
            if template {
                tree.templates
                    .push((name.trim_end_matches('*').to_string(), parent));
            } else if let Some(parent) = parent {
                tree.parents.insert(name, parent);
            }
        }
        tree.templates
            .sort_by_key(|(prefix, _)| std::cmp::Reverse(prefix.len()));
        Ok(tree)
    }

    fn parent(&self, name: &str) -> Option<&str> {
        self.parents.get(name).map(String::as_str).or_else(|| {
            self.templates
                .iter()
                .find(|(prefix, _)| name.starts_with(prefix.as_str()))
                .and_then(|(_, parent)| parent.as_deref())
        })
    }

    /// `name`'s parent and its guarantee there, when it has one (an instance: its template's).
    pub(crate) fn guarantee(&self, name: &str) -> Option<(&str, i64)> {
        let guarantee = self.guarantees.get(name).copied().or_else(|| {
            self.templates
                .iter()
                .find(|(prefix, _)| name.starts_with(prefix.as_str()))
                .and_then(|(prefix, _)| self.guarantees.get(prefix).copied())
        })?;
        Some((self.parent(name)?, guarantee))
    }

    /// `name` and its ancestors, nearest first.
    pub(crate) fn up_from<'a>(&'a self, name: &'a str) -> Vec<&'a str> {
        let mut chain = vec![name];
        while let Some(parent) = chain.last().and_then(|n| self.parent(n)) {
            if chain.len() > 8 || chain.contains(&parent) {
                break;
            }
            chain.push(parent);
        }
        chain
    }

    /// What a request naming `permits` takes from each semaphore, ancestors included.
    pub(crate) fn takes(&self, permits: &[(String, i64)]) -> BTreeMap<String, i64> {
        let mut taken = BTreeMap::new();
        for (name, count) in permits {
            for level in self.up_from(name) {
                *taken.entry(level.to_string()).or_insert(0) += count;
            }
        }
        taken
    }
}

/// Reads the final state.
pub(crate) async fn load(conn: &tokio_postgres::Client) -> Result<FinalState> {
    let requests: Vec<Req> = conn
        .query(
            "SELECT id, external_id, permits, (extract(epoch FROM wait) * 1000000)::int8, state, error_code,
                    created_at, acquired_at, settled_at, release_reason, priority::int8, worker_id,
                    examined_at, decided_at, expires_at, released_at, fencing_token
             FROM permitq.permit_request ORDER BY id",
            &[],
        )
        .await?
        .iter()
        .map(|r| Req {
            id: r.get(0),
            external_id: r.get(1),
            permits: permits_of(&r.get::<_, serde_json::Value>(2)),
            wait_us: r.get(3),
            state: r.get(4),
            error_code: r.get(5),
            created: us(r.get(6)),
            acquired: r.get::<_, Option<SystemTime>>(7).map(us),
            settled: r.get::<_, Option<SystemTime>>(8).map(us),
            release_reason: r.get(9),
            priority: r.get(10),
            worker_id: r.get(11),
            examined: r.get::<_, Option<SystemTime>>(12).map(us),
            decided: r.get::<_, Option<SystemTime>>(13).map(us),
            expires: r.get::<_, Option<SystemTime>>(14).map(us),
            released: r.get::<_, Option<SystemTime>>(15).map(us),
            token: r.get(16),
        })
        .collect();
    let tree = Tree::load(conn).await?;
    let permits = requests
        .iter()
        .filter_map(|r| Some((r, r.acquired?, r.token?)))
        .flat_map(|(r, acquired, token)| {
            tree.takes(&r.permits)
                .into_iter()
                .map(move |(name, count)| (r.id, name, count, acquired, r.released, token))
        })
        .collect();
    let mut capacity: HashMap<String, Vec<(Micros, i64)>> = HashMap::new();
    for r in conn.query("SELECT semaphore, new_capacity::int8, changed_at FROM permitq.capacity_change ORDER BY id", &[]).await? {
        capacity.entry(r.get(0)).or_default().push((us(r.get(2)), r.get(1)));
    }
    let rows = conn
        .query(
            "SELECT name, used::int8, fair, granted FROM permitq.semaphore WHERE NOT is_template",
            &[],
        )
        .await?;
    let semaphores = rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    let granted_counter = rows.iter().map(|r| (r.get(0), r.get(3))).collect();
    let windows = conn
        .query(
            "SELECT name, (extract(epoch FROM per) * 1000000)::int8 FROM permitq.semaphore
             WHERE per IS NOT NULL",
            &[],
        )
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let keyed = conn
        .query(
            "SELECT s.name FROM permitq.keyed_semaphore k
             JOIN permitq.semaphore s ON s.id = k.semaphore_id",
            &[],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    Ok(FinalState {
        keyed,
        requests,
        permits,
        tree,
        capacity,
        semaphores,
        windows,
        granted_counter,
    })
}

impl FinalState {
    /// Every semaphore a grant took from.
    pub(crate) fn held_semaphores(&self) -> std::collections::BTreeSet<&str> {
        self.permits.iter().map(|p| p.1.as_str()).collect()
    }
}

/// The (name, count) pairs of a permits object.
fn permits_of(permits: &serde_json::Value) -> Vec<(String, i64)> {
    permits
        .as_object()
        .map(|o| {
            o.iter()
                .map(|(k, v)| (k.clone(), v.as_i64().unwrap_or(i64::MAX)))
                .collect()
        })
        .unwrap_or_default()
}
