//! The grant protocol as a state machine, checked exhaustively with [stateright].
//!
//! Every step the database lets happen in any order is an action here: producers submitting,
//! cancelling and releasing; leases running out (the sweep); each worker claiming a batch,
//! locking its semaphores (and folding their releases), deciding and applying, and committing,
//! each step interleavable with the others and a crash possible between any two (the worker's
//! transaction rolls back; its token draws do not); a capacity change; and a failover, with a
//! synchronous standby (nothing committed lost) or an asynchronous one (the last commit lost),
//! each followed by the token epoch raise. The decision is permitq's own
//! [`decide`](permitq::decision_model::decide): the model checks the code that decides, not a
//! re-statement of it.
//!
//! Two lock modes: [`LockMode::Wait`], the path the workers run (claim the requests, then lock
//! their semaphores `FOR UPDATE` in id order: a worker waits for another's batch), and
//! [`LockMode::LockFirst`], the rebuilt path's design (docs/design.md, "Step 5: semaphores
//! before requests"): semaphores first, `SKIP LOCKED`, then only the requests whose every
//! semaphore the worker got; a worker that got only part of a request's semaphores and nothing
//! to claim takes its next batch the waiting way.
//!
//! The properties are in [`GrantProtocol::properties`](stateright::Model::properties); the
//! bounds, the states explored and the time are in this crate's README.

use std::collections::{BTreeMap, BTreeSet};

use permitq::decision_model::{decide, Candidate, Head, SemaphoreView, Verdict};
use stateright::{Model, Property};

/// A semaphore of the model.
#[derive(Debug, Clone)]
pub struct SemaphoreSpec {
    /// Its name.
    pub name: &'static str,
    /// Its capacity at the start.
    pub capacity: i64,
    /// Its parent (an index into the semaphores, before it).
    pub parent: Option<usize>,
    /// Its guaranteed share of the parent while active.
    pub guarantee: i64,
}

/// How a worker locks its batch's semaphores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockMode {
    /// `FOR UPDATE` in id order: a worker waits until every semaphore of its batch is free.
    Wait,
    /// Semaphores first, `FOR UPDATE SKIP LOCKED`: a worker locks the free semaphores of the
    /// requests it could claim, then claims only those whose every semaphore it got; the others
    /// are left to the worker that holds them. A worker that got only part of some request's
    /// semaphores and has nothing to claim takes its next batch as [`LockMode::Wait`] does
    /// (the fallback that keeps such a request from being skipped by every worker at once).
    /// Either way may come next in the model, as workers of both ways would run side by side
    /// during a rolling upgrade.
    LockFirst,
}

/// What a failover loses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replication {
    /// Commits wait for the standby: the promoted standby has every commit.
    Synchronous,
    /// The promoted standby may miss the last commit (and the sequence's last draws).
    Asynchronous,
}

/// A bug planted on purpose, to prove that the properties catch it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plant {
    /// A failover does not raise the token epoch.
    NoEpochRaise,
    /// The commit does not delete the releases the lock step folded.
    ReleasesFoldedTwice,
    /// The claim takes rows another worker's transaction holds (no `SKIP LOCKED`).
    ClaimLockedRows,
    /// With `LockFirst`, requests that take from a semaphore another worker holds are claimed
    /// and decided anyway.
    DecideWithoutLocks,
    /// The decision is not told the heads of the lines (the waiters outside its batch).
    NoHeads,
    /// The second worker takes its semaphore locks in descending order (`LockMode::Wait`).
    LocksUnsorted,
    /// A crashed worker's claimed rows stay locked (its transaction is not rolled back).
    ClaimNotReturnedOnCrash,
    /// The decision is not told the children's guarantees: a borrower ignores the reserve.
    ReserveIgnored,
    /// The lease sweep releases what it selected without checking the lease again under the
    /// row lock: a heartbeat in between is lost.
    SweepWithoutRecheck,
}

/// The protocol and its bounds.
#[derive(Debug, Clone)]
pub struct GrantProtocol {
    /// The semaphores (a parent before its children).
    pub semaphores: Vec<SemaphoreSpec>,
    /// Each request's permits: semaphore index → count.
    pub requests: Vec<Vec<(usize, i64)>>,
    /// The requests with a lease (a ttl: heartbeats, expiry and the sweep); the others are held
    /// until released.
    pub leased: Vec<usize>,
    /// How many workers run.
    pub workers: usize,
    /// How many worker crashes may happen.
    pub crashes: u8,
    /// A capacity change that may happen once: semaphore index, new capacity.
    pub capacity_change: Option<(usize, i64)>,
    /// A failover that may happen once.
    pub failover: Option<Replication>,
    /// How workers lock.
    pub lock_mode: LockMode,
    /// A planted bug, or none.
    pub plant: Option<Plant>,
}

/// Where a request is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RequestState {
    /// Not submitted (yet, or its submit was lost in an asynchronous failover).
    Unsubmitted,
    /// Waiting.
    New,
    /// Granted.
    Acquired,
    /// Given back (released, or its lease ran out).
    Released,
    /// Never granted, with its error code.
    Error(&'static str),
}

/// A request's row.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RequestRow {
    /// Its state.
    pub state: RequestState,
    /// A worker decided it and left it waiting (it has waiter rows: it is in its lines).
    pub examined: bool,
    /// Its fencing token, once granted.
    pub token: Option<u64>,
    /// What its grant took: semaphore index → count (what it names and every ancestor).
    pub charged: Vec<(usize, i64)>,
    /// Its lease has not run out (granted or heartbeaten since time last passed).
    pub lease_fresh: bool,
}

/// A semaphore's row.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SemaphoreRow {
    /// Its capacity.
    pub capacity: i64,
    /// The workers' count: permits held plus releases not folded yet.
    pub used: i64,
    /// Releases not folded yet (`pending_release`).
    pub pending: i64,
}

/// The database: what is committed on the primary.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Database {
    /// One row per request.
    pub requests: Vec<RequestRow>,
    /// One row per semaphore.
    pub semaphores: Vec<SemaphoreRow>,
    /// The fencing token sequence (not transactional: a rolled-back draw is not given back).
    pub sequence: u64,
    /// The token epoch, raised on a new timeline.
    pub epoch: u64,
    /// Every committed grant, in commit order: request index and token.
    pub grants: Vec<(usize, u64)>,
}

/// A worker's open transaction.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Phase {
    /// No transaction.
    Idle,
    /// Claimed these requests (their rows locked).
    Claimed(Vec<usize>),
    /// Taking the batch's semaphore locks one at a time, in lock order (`LockMode::Wait`).
    Locking {
        /// Every claimed request.
        claimed: Vec<usize>,
        /// The locks still to take, next first.
        order: Vec<usize>,
        /// The locks taken.
        locked: Vec<usize>,
    },
    /// Locked these semaphores (folding these releases: semaphore index → count) and will
    /// decide these of its claimed requests (the others take from a semaphore it skipped).
    Locked {
        /// Every claimed request (row-locked until the commit).
        claimed: Vec<usize>,
        /// Those it decides.
        decided: Vec<usize>,
        /// The semaphores it locked.
        locked: Vec<usize>,
        /// The releases it folds.
        folded: Vec<(usize, i64)>,
    },
    /// Applied the decision; the commit is next.
    Applied {
        /// Every claimed request.
        claimed: Vec<usize>,
        /// The semaphores it locked.
        locked: Vec<usize>,
        /// The releases it folds.
        folded: Vec<(usize, i64)>,
        /// Each decided request's new row.
        outcomes: Vec<(usize, RequestRow)>,
        /// Each locked semaphore's `used` after the grants.
        used: Vec<(usize, i64)>,
    },
}

/// What a lock-first claim takes.
#[derive(Debug)]
struct LockFirst {
    /// The requests it claims.
    claimed: Vec<usize>,
    /// The semaphores it locks.
    locked: Vec<usize>,
    /// Whether another worker held a semaphore it wanted.
    skipped: bool,
    /// Whether it got part of some request's semaphores while another worker held the rest.
    partly_held: bool,
}

/// A state of the whole system.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SystemState {
    /// What the primary has committed.
    pub db: Database,
    /// The database before its last commit: what an asynchronous standby may have.
    pub before_last_commit: Option<Box<Database>>,
    /// Each worker's transaction.
    pub workers: Vec<Phase>,
    /// Crashes still allowed.
    pub crashes_left: u8,
    /// Whether the capacity change may still happen.
    pub capacity_change_left: bool,
    /// Whether the failover may still happen.
    pub failover_left: bool,
    /// The highest token ever drawn, by any copy (lost ones included).
    pub highest_token_drawn: u64,
    /// Request rows a crashed transaction still holds (only with a planted bug).
    pub leaked_rows: Vec<usize>,
    /// The requests the lease sweep selected as expired, to release next.
    pub sweep_selected: Vec<usize>,
    /// The first broken rule a step saw, if any.
    pub violation: Option<String>,
    /// What happened, for the "sometimes" properties.
    pub seen: Seen,
}

/// Interesting things that happened, so that no property holds vacuously.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Seen {
    /// A request was left waiting, and granted later.
    pub waited_then_granted: bool,
    /// A grant borrowed at a parent.
    pub borrowed: bool,
    /// A worker skipped a semaphore another held.
    pub skipped: bool,
    /// A lock-first claim got part of a request's semaphores, another worker held the rest.
    pub partly_held: bool,
    /// A worker crashed after applying its decision.
    pub crashed_after_apply: bool,
    /// A grant committed after a failover.
    pub granted_after_failover: bool,
    /// Two workers held open batches at once.
    pub concurrent_batches: bool,
    /// A failover happened.
    pub failed_over: bool,
    /// A heartbeat came between the sweep's select and its release, and the lease was kept.
    pub heartbeat_beat_the_sweep: bool,
}

/// A step.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Action {
    /// A producer submits request `r` (again, after an asynchronous failover lost it).
    Submit(usize),
    /// Its producer releases request `r` (it holds it).
    Release(usize),
    /// Its producer cancels request `r` while it waits (or its wait runs out: the same step).
    Cancel(usize),
    /// Time passes for request `r`'s lease: without a heartbeat it has run out.
    Tick(usize),
    /// Its holder heartbeats request `r` (`permitq.heartbeat`): the lease is fresh again.
    Heartbeat(usize),
    /// The lease sweep (`permitq.sweep_expired`) selects request `r`, whose lease ran out.
    SweepSelect(usize),
    /// The sweep releases request `r` as `expired`, checking the lease again under its row lock.
    SweepRelease(usize),
    /// Worker `w` claims its batch (in `LockFirst`: locks its free semaphores first, then claims
    /// the requests whose every semaphore it got).
    Claim(usize),
    /// Worker `w`, whose lock-first claim would hold part of a request's semaphores and claim
    /// nothing, claims its batch the waiting way (`LockMode::Wait`'s claim, then its locks).
    ClaimWaiting(usize),
    /// Worker `w` locks its batch's semaphores and folds their releases.
    Lock(usize),
    /// Worker `w` decides (permitq's `decide`) and applies.
    Apply(usize),
    /// Worker `w` commits.
    Commit(usize),
    /// Worker `w` crashes: its transaction rolls back.
    Crash(usize),
    /// An admin changes a capacity.
    SetCapacity,
    /// The primary fails over to its standby.
    Failover,
}

/// Each step of the model and the SQL function (or Rust step) it stands for: a test fails when
/// one of these functions is no longer in the schema, so a change of the protocol changes the
/// model first.
pub const STEPS: &[(&str, &str)] = &[
    ("Submit", "permitq.submit"),
    ("Release", "permitq.release"),
    ("Cancel", "permitq.cancel"),
    ("Heartbeat", "permitq.heartbeat"),
    ("SweepSelect, SweepRelease", "permitq.sweep_expired"),
    (
        "Cancel (a wait that ran out)",
        "permitq.sweep_wait_deadlines",
    ),
    ("Claim", "permitq.claim_batch"),
    ("Lock", "permitq.lock_batch_semaphores"),
    ("Lock (the fold)", "permitq.fold_pending_releases"),
    ("Apply (the heads)", "permitq.semaphore_heads"),
    ("Apply (the decision)", "decision::decide"),
    ("Apply, Commit", "permitq.apply_decision"),
    ("SetCapacity", "permitq.set_capacity"),
    ("Failover (the epoch raise)", "permitq.raise_token_epoch"),
];

/// Tokens carry their epoch above this many draws.
const EPOCH_SHIFT: u64 = 1 << 20;

impl GrantProtocol {
    /// The bounds the issue asks for: 2 workers, 3 requests, 2 semaphores (one nested, with a
    /// guarantee), one crash, one capacity change, one failover.
    #[must_use]
    pub fn standard(lock_mode: LockMode, replication: Replication) -> GrantProtocol {
        GrantProtocol {
            semaphores: vec![
                SemaphoreSpec {
                    name: "pool",
                    capacity: 3,
                    parent: None,
                    guarantee: 0,
                },
                SemaphoreSpec {
                    name: "team",
                    capacity: 2,
                    parent: Some(0),
                    guarantee: 1,
                },
            ],
            // Within team's guarantee; a borrower naming the parent; one taking all of team.
            requests: vec![vec![(1, 1)], vec![(0, 2)], vec![(1, 2)]],
            // One lease is enough for the sweep's races with heartbeats and releases.
            leased: vec![0],
            workers: 2,
            crashes: 1,
            capacity_change: Some((0, 2)),
            failover: Some(replication),
            lock_mode,
            plant: None,
        }
    }

    /// Bounds where a child's first in line waits for room on its parent within the child's
    /// guarantee: `pool` 3; `team` 3, guaranteed 2. A request naming the pool borrows 2 while
    /// team is idle; team's 2 then wait for 1 more; team's later 1 must not take the pool's
    /// free permit ahead of them. 2 workers, no crash, no capacity change, no failover.
    #[must_use]
    pub fn guarantee_line(lock_mode: LockMode) -> GrantProtocol {
        GrantProtocol::small(
            lock_mode,
            vec![spec("pool", 3, None, 0), spec("team", 3, Some(0), 2)],
            vec![vec![(0, 2)], vec![(1, 2)], vec![(1, 1)]],
        )
    }

    /// Bounds where a child's head borrows at the parent and must leave a sibling's reserve,
    /// while a later request of the child, within both guarantees, keeps the sibling active:
    /// `pool` 4; `y` and `z` 4 each, guaranteed 2 each. Neither may wait for the other for
    /// good (the property that no request is stuck). 2 workers, nothing else.
    #[must_use]
    pub fn reserve_cycle(lock_mode: LockMode) -> GrantProtocol {
        GrantProtocol::small(
            lock_mode,
            vec![
                spec("pool", 4, None, 0),
                spec("y", 4, Some(0), 2),
                spec("z", 4, Some(0), 2),
            ],
            vec![vec![(2, 1)], vec![(1, 3)], vec![(1, 1), (2, 1)]],
        )
    }

    /// Bounds where one request takes through a guaranteed child within its guarantee and
    /// names the parent too: `pool` 2; `y` 2, guaranteed 2; `y=1, pool=1`. Left waiting once, its
    /// own waiter row must not keep y's guarantee in reserve against it (it did, for ever).
    #[must_use]
    pub fn self_reserve(lock_mode: LockMode) -> GrantProtocol {
        GrantProtocol::small(
            lock_mode,
            vec![spec("pool", 2, None, 0), spec("y", 2, Some(0), 2)],
            vec![vec![(0, 2)], vec![(1, 1), (0, 1)]],
        )
    }

    /// Bounds of a nesting case alone: these semaphores and requests, 2 workers, no lease, no
    /// crash, no capacity change, no failover.
    fn small(
        lock_mode: LockMode,
        semaphores: Vec<SemaphoreSpec>,
        requests: Vec<Vec<(usize, i64)>>,
    ) -> GrantProtocol {
        GrantProtocol {
            semaphores,
            requests,
            leased: vec![],
            workers: 2,
            crashes: 0,
            capacity_change: None,
            failover: None,
            lock_mode,
            plant: None,
        }
    }

    /// Bounds where lock-first batches run side by side: 2 workers, 3 requests (one on `a`, one
    /// on `b`, one on both: a worker may hold one of its semaphores while another holds the
    /// other), 2 semaphores of capacity 1, not nested, one crash, one failover.
    #[must_use]
    pub fn independent(lock_mode: LockMode, replication: Replication) -> GrantProtocol {
        let semaphore = |name| SemaphoreSpec {
            name,
            capacity: 1,
            parent: None,
            guarantee: 0,
        };
        GrantProtocol {
            semaphores: vec![semaphore("a"), semaphore("b")],
            requests: vec![vec![(0, 1)], vec![(1, 1)], vec![(0, 1), (1, 1)]],
            leased: vec![0],
            workers: 2,
            crashes: 1,
            capacity_change: None,
            failover: Some(replication),
            lock_mode,
            plant: None,
        }
    }

    /// Whether requests `a` and `b` take from a semaphore in common.
    fn share_a_semaphore(&self, a: usize, b: usize) -> bool {
        let taken = self.takes(b);
        self.takes(a).keys().any(|s| taken.contains_key(s))
    }

    /// Semaphore `s` and its ancestors, nearest first.
    fn chain(&self, s: usize) -> Vec<usize> {
        let mut chain = vec![s];
        let mut at = s;
        while let Some(parent) = self.semaphores[at].parent {
            chain.push(parent);
            at = parent;
        }
        chain
    }

    /// What granting request `r` takes: semaphore index → count, ancestors included.
    fn takes(&self, r: usize) -> BTreeMap<usize, i64> {
        let mut taken = BTreeMap::new();
        for &(s, count) in &self.requests[r] {
            for a in self.chain(s) {
                *taken.entry(a).or_insert(0) += count;
            }
        }
        taken
    }

    /// Requests whose rows a worker's transaction holds, and semaphores it holds.
    fn locks(state: &SystemState, except: Option<usize>) -> (BTreeSet<usize>, BTreeSet<usize>) {
        let mut requests = BTreeSet::new();
        let mut semaphores = BTreeSet::new();
        for (w, phase) in state.workers.iter().enumerate() {
            if Some(w) == except {
                continue;
            }
            match phase {
                Phase::Idle => {}
                Phase::Claimed(claimed) => requests.extend(claimed),
                Phase::Locking {
                    claimed, locked, ..
                } => {
                    requests.extend(claimed);
                    semaphores.extend(locked);
                }
                Phase::Locked {
                    claimed, locked, ..
                }
                | Phase::Applied {
                    claimed, locked, ..
                } => {
                    requests.extend(claimed);
                    semaphores.extend(locked);
                }
            }
        }
        requests.extend(&state.leaked_rows);
        (requests, semaphores)
    }

    /// The semaphores worker `w`'s batch of `claimed` locks, in the order it takes them: id
    /// order (here, index order), as permitq.lock_named takes them.
    fn lock_order(&self, claimed: &[usize], w: usize) -> Vec<usize> {
        let mut order: Vec<usize> = claimed
            .iter()
            .flat_map(|r| self.takes(*r).into_keys())
            .collect();
        order.sort_unstable();
        order.dedup();
        if self.plant == Some(Plant::LocksUnsorted) && w == 1 {
            order.reverse();
        }
        order
    }

    /// Permits held on `s` now: the charges of the acquired requests.
    fn held(db: &Database, s: usize) -> i64 {
        db.requests
            .iter()
            .filter(|r| r.state == RequestState::Acquired)
            .flat_map(|r| r.charged.iter())
            .filter(|(at, _)| *at == s)
            .map(|(_, count)| count)
            .sum()
    }

    /// Requests waiting in `s`'s line (examined, still new) other than `except`.
    fn waiting_on(&self, db: &Database, s: usize, except: &[usize]) -> Vec<usize> {
        (0..self.requests.len())
            .filter(|r| {
                let row = &db.requests[*r];
                row.state == RequestState::New
                    && row.examined
                    && !except.contains(r)
                    && self.takes(*r).contains_key(&s)
            })
            .collect()
    }

    /// What a claim takes: new requests no other transaction holds, not examined yet or with
    /// room on every semaphore they take from (the workers' "ready" heads).
    fn claimable(&self, state: &SystemState) -> Vec<usize> {
        let (mut locked_requests, _) = Self::locks(state, None);
        if self.plant == Some(Plant::ClaimLockedRows) {
            locked_requests.clear();
        }
        (0..self.requests.len())
            .filter(|r| {
                let row = &state.db.requests[*r];
                row.state == RequestState::New
                    && !locked_requests.contains(r)
                    && (!row.examined
                        || self.takes(*r).iter().all(|(s, count)| {
                            let sem = &state.db.semaphores[*s];
                            sem.capacity - sem.used + sem.pending >= *count
                        }))
            })
            .collect()
    }

    /// Worker `w`'s lock-first claim (`LockMode::LockFirst`): of the semaphores the claimable requests take from, it
    /// locks those no other transaction holds (`SKIP LOCKED`: it never waits), then claims the
    /// requests whose every semaphore it got. The model claims every such request, a superset of
    /// what a batch takes.
    fn lock_first(&self, state: &SystemState, w: usize) -> LockFirst {
        let (_, others) = Self::locks(state, Some(w));
        let candidates = self.claimable(state);
        let needs: BTreeSet<usize> = candidates
            .iter()
            .flat_map(|r| self.takes(*r).into_keys())
            .collect();
        let locked: Vec<usize> = needs.difference(&others).copied().collect();
        let partly_held = candidates.iter().any(|r| {
            let takes = self.takes(*r);
            takes.keys().any(|s| locked.contains(s)) && takes.keys().any(|s| others.contains(s))
        });
        let claimed = candidates
            .into_iter()
            .filter(|r| {
                let takes = self.takes(*r);
                takes.keys().all(|s| locked.contains(s))
                    || (self.plant == Some(Plant::DecideWithoutLocks)
                        && takes.keys().any(|s| locked.contains(s)))
            })
            .collect();
        LockFirst {
            claimed,
            skipped: locked.len() < needs.len(),
            partly_held,
            locked,
        }
    }

    /// A holder's release (`permitq.release`) or the sweep's: the permits go back to be folded.
    fn release(state: &mut SystemState, r: usize) {
        Self::committing(state);
        state.db.requests[r].state = RequestState::Released;
        for (s, count) in state.db.requests[r].charged.clone() {
            state.db.semaphores[s].pending += count;
        }
    }

    /// A commit of the producer's or an admin's: remember what an asynchronous standby has.
    fn committing(state: &mut SystemState) {
        state.before_last_commit = Some(Box::new(state.db.clone()));
    }

    fn violate(state: &mut SystemState, what: String) {
        if state.violation.is_none() {
            state.violation = Some(what);
        }
    }

    /// The views and candidates the decision gets from worker `w`'s locked batch.
    fn decision_input(
        &self,
        db: &Database,
        decided: &[usize],
        locked: &[usize],
        folded: &[(usize, i64)],
    ) -> (BTreeMap<String, SemaphoreView>, Vec<Candidate>) {
        let name = |s: usize| self.semaphores[s].name.to_string();
        let mut views = BTreeMap::new();
        for (s, spec) in self.semaphores.iter().enumerate() {
            let row = &db.semaphores[s];
            // Locked: its releases folded. Read, not locked (a guaranteed child): less its
            // releases not folded yet, as the lock step reads it.
            let used = if locked.contains(&s) {
                row.used - folded.iter().find(|(f, _)| *f == s).map_or(0, |f| f.1)
            } else {
                row.used - row.pending
            };
            // The first in line of the waiters not in this batch.
            let head = self
                .waiting_on(db, s, decided)
                .first()
                .filter(|_| self.plant != Some(Plant::NoHeads))
                .map(|&r| Head {
                    request_id: id(r),
                    count: self.takes(r)[&s],
                    effective: effective(r),
                });
            // Active: holds, or a request waits within its unused guarantee.
            let active = used > 0
                || self
                    .waiting_on(db, s, &[])
                    .iter()
                    .any(|w| self.takes(*w)[&s] <= (spec.guarantee - used).max(0));
            views.insert(
                name(s),
                SemaphoreView {
                    capacity: row.capacity,
                    used,
                    fair: true,
                    head,
                    refused: false,
                    parent: spec.parent.map(name),
                    guarantee: if self.plant == Some(Plant::ReserveIgnored) {
                        0
                    } else {
                        spec.guarantee
                    },
                    active,
                },
            );
        }
        let candidates = decided
            .iter()
            .map(|&r| Candidate {
                id: id(r),
                effective: effective(r),
                permits: self.requests[r]
                    .iter()
                    .map(|&(s, count)| (name(s), count))
                    .collect(),
                fail_fast: false,
                deadline_passed: false,
                invalid: false,
            })
            .collect();
        (views, candidates)
    }

    fn apply(&self, state: &mut SystemState, w: usize) {
        let Phase::Locked {
            claimed,
            decided,
            locked,
            folded,
        } = state.workers[w].clone()
        else {
            return;
        };
        let (views, candidates) = self.decision_input(&state.db, &decided, &locked, &folded);
        let decision = decide(&views, &candidates);
        let mut outcomes = Vec::new();
        // Tokens are drawn in id order (candidates are), from the sequence: a draw is not given
        // back when the transaction rolls back.
        for (r, (_, verdict)) in decided.iter().zip(&decision.verdicts) {
            let mut row = state.db.requests[*r].clone();
            match verdict {
                Verdict::Grant => {
                    state.db.sequence += 1;
                    let token = state.db.epoch * EPOCH_SHIFT + state.db.sequence;
                    // Above every token any copy ever drew, lost commits and failovers included.
                    if token <= state.highest_token_drawn {
                        Self::violate(
                            state,
                            format!(
                                "token {token} drawn again (highest so far {})",
                                state.highest_token_drawn
                            ),
                        );
                    }
                    state.highest_token_drawn = state.highest_token_drawn.max(token);
                    row.state = RequestState::Acquired;
                    row.token = Some(token);
                    row.lease_fresh = true;
                    row.charged = self.takes(*r).into_iter().collect();
                }
                Verdict::Fail(code) => row.state = RequestState::Error(code.as_str()),
                Verdict::Wait => row.examined = true,
            }
            outcomes.push((*r, row));
        }
        let used = locked
            .iter()
            .map(|&s| (s, decision.semaphores[self.semaphores[s].name].used))
            .collect();
        state.workers[w] = Phase::Applied {
            claimed,
            locked,
            folded,
            outcomes,
            used,
        };
    }

    fn commit(&self, state: &mut SystemState, w: usize) {
        let Phase::Applied {
            outcomes,
            used,
            folded,
            ..
        } = state.workers[w].clone()
        else {
            return;
        };
        Self::committing(state);
        let before = state.db.clone();
        for (r, row) in &outcomes {
            if before.requests[*r].state != RequestState::New {
                Self::violate(state, format!("worker {w} decided request {r}, not new"));
            }
            if row.state == RequestState::Acquired {
                let token = row.token.unwrap_or(0);
                // Per semaphore: grants on semaphores that share nothing commit in any order.
                if state
                    .db
                    .grants
                    .iter()
                    .any(|(g, t)| *t >= token && self.share_a_semaphore(*g, *r))
                {
                    Self::violate(
                        state,
                        format!(
                            "token {token} not above every earlier grant's on a semaphore it takes from"
                        ),
                    );
                }
                if state.db.grants.iter().any(|(g, _)| g == r) {
                    Self::violate(state, format!("request {r} granted twice"));
                }
                state.db.grants.push((*r, token));
                if before.requests[*r].examined {
                    state.seen.waited_then_granted = true;
                }
                if !state.failover_left {
                    state.seen.granted_after_failover = true;
                }
            }
            state.db.requests[*r] = row.clone();
        }
        if self.plant != Some(Plant::ReleasesFoldedTwice) {
            for (s, count) in &folded {
                state.db.semaphores[*s].pending -= count;
            }
        }
        for (s, u) in &used {
            state.db.semaphores[*s].used = *u;
        }
        state.workers[w] = Phase::Idle;
        self.check_grants(state, &before, &outcomes);
    }

    /// After a commit: no level over capacity where it granted, and a borrower left each
    /// parent the unused guarantees of its other active children.
    fn check_grants(
        &self,
        state: &mut SystemState,
        before: &Database,
        outcomes: &[(usize, RequestRow)],
    ) {
        let granted: Vec<usize> = outcomes
            .iter()
            .filter(|(r, row)| {
                row.state == RequestState::Acquired && before.requests[*r].token.is_none()
            })
            .map(|(r, _)| *r)
            .collect();
        // What the batch's grants ahead of each one took: the decision measures a child's
        // unused guarantee after them.
        let mut ahead: BTreeMap<usize, i64> = BTreeMap::new();
        for &r in &granted {
            let unused = |c: usize| {
                let held = Self::held(before, c) + ahead.get(&c).copied().unwrap_or(0);
                (self.semaphores[c].guarantee - held).max(0)
            };
            for (s, _) in self.takes(r) {
                let (held, capacity) = (Self::held(&state.db, s), state.db.semaphores[s].capacity);
                if held > capacity {
                    let name = self.semaphores[s].name;
                    Self::violate(state, format!("{name} over capacity: {held} > {capacity}"));
                }
                // Safe backfill: granted behind the first in line (waiting before this batch,
                // and still), it left that request's count free. Where it takes within a
                // child's guarantee (not naming the semaphore, not borrowing there), the first
                // in line of what it names below (the child's line), with its count there, and
                // only a head that borrows nowhere above it (one that borrows takes its turn in
                // the parents' lines), not the whole line's.
                let still_waiting = |h: &usize| state.db.requests[*h].state == RequestState::New;
                let heads: Vec<(usize, i64)> = if self.requests[r].iter().any(|(n, _)| *n == s)
                    || self.borrows_at(r, s, &unused)
                {
                    self.waiting_on(before, s, &[])
                        .into_iter()
                        .find(still_waiting)
                        .map(|h| (h, self.takes(h)[&s]))
                        .into_iter()
                        .collect()
                } else {
                    self.requests[r]
                        .iter()
                        .filter(|(n, _)| self.chain(*n).contains(&s))
                        .filter_map(|&(n, _)| {
                            let h = self
                                .waiting_on(before, n, &[])
                                .into_iter()
                                .find(still_waiting)?;
                            let count = self.takes(h)[&n];
                            let borrows = self.chain(n)[..self.chain(n).len() - 1]
                                .iter()
                                .any(|c| count > unused(*c));
                            (!borrows).then_some((h, count))
                        })
                        .collect()
                };
                for (h, needs) in heads.into_iter().filter(|(h, _)| *h < r) {
                    let free = capacity - held;
                    if free < needs {
                        let name = self.semaphores[s].name;
                        Self::violate(
                            state,
                            format!("request {r} went before {h}, first in line at {name}, leaving {free} of the {needs} it needs"),
                        );
                    }
                }
            }
            for (p, _) in self.semaphores.iter().enumerate() {
                let children: Vec<usize> = (0..self.semaphores.len())
                    .filter(|c| self.semaphores[*c].parent == Some(p))
                    .collect();
                if children.is_empty() || !self.borrows_at(r, p, &unused) {
                    continue;
                }

                state.seen.borrowed = true;
                // The children active before this batch (an idle child's share is lent: one
                // made active later in the batch, behind the borrower, waits for it).
                // Every other child: not one the grant itself takes through.
                let kept: i64 = children
                    .iter()
                    .filter(|c| !self.takes(r).contains_key(c))
                    .filter(|c| {
                        let unused =
                            (self.semaphores[**c].guarantee - Self::held(before, **c)).max(0);
                        Self::held(before, **c) > 0
                            || self
                                .waiting_on(before, **c, &[])
                                .iter()
                                .any(|w| self.takes(*w)[c] <= unused)
                    })
                    .map(|c| (self.semaphores[*c].guarantee - Self::held(&state.db, *c)).max(0))
                    .sum();
                let free = state.db.semaphores[p].capacity - Self::held(&state.db, p);
                if free < kept {
                    let name = self.semaphores[p].name;
                    Self::violate(
                        state,
                        format!("request {r} borrowed at {name} and left {free} free, under the {kept} kept"),
                    );
                }
            }
            for (s, count) in self.takes(r) {
                *ahead.entry(s).or_insert(0) += count;
            }
        }
    }

    /// Whether granting request `r` borrows at `p`: it names `p`, or takes more through a child
    /// of `p` than the child's unused guarantee (`unused`) had room for before the grant.
    fn borrows_at(&self, r: usize, p: usize, unused: &impl Fn(usize) -> i64) -> bool {
        let taken = self.takes(r);
        self.requests[r].iter().any(|(s, _)| *s == p)
            || (0..self.semaphores.len())
                .filter(|c| self.semaphores[*c].parent == Some(p))
                .any(|c| taken.get(&c).is_some_and(|k| *k > unused(c)))
    }

    /// After every step, what the rows must always say (a broken one ends the path, so that a
    /// planted bug cannot make the state space unbounded): `used` counts exactly the permits
    /// held and the releases not folded, and every grant took its count from what it names and
    /// each ancestor.
    fn check_rows(&self, state: &mut SystemState) {
        for s in 0..self.semaphores.len() {
            let row = &state.db.semaphores[s];
            let held = Self::held(&state.db, s);
            if row.used != held + row.pending {
                let what = format!(
                    "{}: used {} but {held} held and {} released not folded",
                    self.semaphores[s].name, row.used, row.pending
                );
                Self::violate(state, what);
            }
        }
        for r in 0..self.requests.len() {
            let row = &state.db.requests[r];
            if row.state == RequestState::Acquired
                && row.charged != self.takes(r).into_iter().collect::<Vec<_>>()
            {
                Self::violate(state, format!("request {r} charged {:?}", row.charged));
            }
        }
    }

    /// No action is possible (a claimed row never returned, for one: a cancel waits for it).
    fn quiescent(&self, state: &SystemState) -> bool {
        let mut actions = Vec::new();
        self.actions(state, &mut actions);
        actions.is_empty()
    }

    /// Waiting requests that nothing but a cancel or a timeout will ever move: every worker
    /// idle, nothing held (no release will come), every waiting request examined, and the
    /// decision, given all of them at once with every release folded, grants none. (While a
    /// request waits unclaimed, a cancel or a claim that decides it again is always possible:
    /// [`Self::quiescent`] does not see this.)
    fn stuck(&self, state: &SystemState) -> bool {
        let db = &state.db;
        let waiting: Vec<usize> = (0..self.requests.len())
            .filter(|r| db.requests[*r].state == RequestState::New)
            .collect();
        if waiting.is_empty()
            || state.workers.iter().any(|p| *p != Phase::Idle)
            || waiting.iter().any(|r| !db.requests[*r].examined)
            || db
                .requests
                .iter()
                .any(|r| r.state == RequestState::Acquired)
        {
            return false;
        }
        let every: Vec<usize> = (0..self.semaphores.len()).collect();
        let folded: Vec<(usize, i64)> = every
            .iter()
            .map(|s| (*s, db.semaphores[*s].pending))
            .collect();
        let (views, candidates) = self.decision_input(db, &waiting, &every, &folded);
        decide(&views, &candidates)
            .verdicts
            .iter()
            .all(|(_, v)| *v == Verdict::Wait)
    }
}

/// A semaphore of the bounds: `parent` by index.
fn spec(name: &'static str, capacity: i64, parent: Option<usize>, guarantee: i64) -> SemaphoreSpec {
    SemaphoreSpec {
        name,
        capacity,
        parent,
        guarantee,
    }
}

/// A request's id in the decision (1-based, its FIFO position).
fn id(r: usize) -> i64 {
    i64::try_from(r).unwrap_or(i64::MAX) + 1
}

/// Every request at priority 0, created in index order: the earlier, the higher.
fn effective(r: usize) -> i64 {
    -id(r)
}

impl Model for GrantProtocol {
    type State = SystemState;
    type Action = Action;

    fn init_states(&self) -> Vec<SystemState> {
        vec![SystemState {
            db: Database {
                requests: vec![
                    RequestRow {
                        state: RequestState::Unsubmitted,
                        examined: false,
                        token: None,
                        charged: Vec::new(),
                        lease_fresh: false,
                    };
                    self.requests.len()
                ],
                semaphores: self
                    .semaphores
                    .iter()
                    .map(|s| SemaphoreRow {
                        capacity: s.capacity,
                        used: 0,
                        pending: 0,
                    })
                    .collect(),
                sequence: 0,
                epoch: 1,
                grants: Vec::new(),
            },
            before_last_commit: None,
            workers: vec![Phase::Idle; self.workers],
            crashes_left: self.crashes,
            capacity_change_left: self.capacity_change.is_some(),
            failover_left: self.failover.is_some(),
            highest_token_drawn: 0,
            leaked_rows: Vec::new(),
            sweep_selected: Vec::new(),
            violation: None,
            seen: Seen::default(),
        }]
    }

    fn actions(&self, state: &SystemState, actions: &mut Vec<Action>) {
        if state.violation.is_some() {
            return;
        }
        let (locked_requests, locked_semaphores) = Self::locks(state, None);
        for (r, row) in state.db.requests.iter().enumerate() {
            match row.state {
                RequestState::Unsubmitted => actions.push(Action::Submit(r)),
                RequestState::New if !locked_requests.contains(&r) => {
                    actions.push(Action::Cancel(r));
                }
                RequestState::Acquired if !self.leased.contains(&r) => {
                    actions.push(Action::Release(r));
                }
                RequestState::Acquired => {
                    actions.push(Action::Release(r));
                    if row.lease_fresh {
                        actions.push(Action::Tick(r));
                    } else {
                        actions.push(Action::Heartbeat(r));
                        if !state.sweep_selected.contains(&r) {
                            actions.push(Action::SweepSelect(r));
                        }
                    }
                }
                _ => {}
            }
        }
        for &r in &state.sweep_selected {
            actions.push(Action::SweepRelease(r));
        }
        let claimable = !self.claimable(state).is_empty();
        for (w, phase) in state.workers.iter().enumerate() {
            match phase {
                Phase::Idle if self.lock_mode == LockMode::LockFirst => {
                    // A lock-first batch that finds nothing to claim commits at once: a step
                    // that changes nothing but what was seen.
                    if claimable {
                        actions.push(Action::Claim(w));
                    }
                    // The fallback, and a worker of the previous release during an upgrade:
                    // either may claim the waiting way whenever something is claimable.
                    if claimable {
                        actions.push(Action::ClaimWaiting(w));
                    }
                }
                Phase::Idle if claimable => actions.push(Action::Claim(w)),
                Phase::Idle => {}
                Phase::Claimed(claimed) => {
                    // `FOR UPDATE` waits while another transaction holds the next one.
                    let (_, others) = Self::locks(state, Some(w));
                    let order = self.lock_order(claimed, w);
                    if order.first().is_none_or(|s| !others.contains(s)) {
                        actions.push(Action::Lock(w));
                    }
                }
                Phase::Locking { order, .. } => {
                    let (_, others) = Self::locks(state, Some(w));
                    if order.first().is_some_and(|s| !others.contains(s)) {
                        actions.push(Action::Lock(w));
                    }
                }
                Phase::Locked { .. } => actions.push(Action::Apply(w)),
                Phase::Applied { .. } => actions.push(Action::Commit(w)),
            }
            if *phase != Phase::Idle && state.crashes_left > 0 {
                actions.push(Action::Crash(w));
            }
        }
        if let (true, Some((s, _))) = (state.capacity_change_left, self.capacity_change) {
            // set_capacity waits for the semaphore's row lock.
            if !locked_semaphores.contains(&s) {
                actions.push(Action::SetCapacity);
            }
        }
        if state.failover_left {
            actions.push(Action::Failover);
        }
    }

    fn next_state(&self, last: &SystemState, action: Action) -> Option<SystemState> {
        let mut state = last.clone();
        match action {
            Action::Submit(r) => {
                Self::committing(&mut state);
                state.db.requests[r].state = RequestState::New;
            }
            Action::Release(r) => Self::release(&mut state, r),
            Action::Tick(r) => state.db.requests[r].lease_fresh = false,
            Action::Heartbeat(r) => {
                Self::committing(&mut state);
                state.db.requests[r].lease_fresh = true;
            }
            Action::SweepSelect(r) => state.sweep_selected.push(r),
            Action::SweepRelease(r) => {
                state.sweep_selected.retain(|x| *x != r);
                let row = &state.db.requests[r];
                let recheck = self.plant != Some(Plant::SweepWithoutRecheck);
                if row.state == RequestState::Acquired && recheck && row.lease_fresh {
                    state.seen.heartbeat_beat_the_sweep = true;
                }
                let row = &state.db.requests[r];
                if row.state == RequestState::Acquired && (!recheck || !row.lease_fresh) {
                    if row.lease_fresh {
                        Self::violate(
                            &mut state,
                            format!(
                                "request {r} released as expired after a heartbeat extended it"
                            ),
                        );
                    }
                    Self::release(&mut state, r);
                }
            }
            Action::Cancel(r) => {
                Self::committing(&mut state);
                state.db.requests[r].state = RequestState::Error("cancelled");
            }
            Action::Claim(w) if self.lock_mode == LockMode::LockFirst => {
                let LockFirst {
                    claimed,
                    locked,
                    skipped,
                    partly_held,
                } = self.lock_first(&state, w);
                state.seen.skipped |= skipped;
                state.seen.partly_held |= partly_held;
                if state.workers.iter().any(|p| !matches!(p, Phase::Idle)) {
                    state.seen.concurrent_batches = true;
                }
                let folded = locked
                    .iter()
                    .map(|&s| (s, state.db.semaphores[s].pending))
                    .filter(|(_, count)| *count > 0)
                    .collect();
                if !claimed.is_empty() {
                    state.workers[w] = Phase::Locked {
                        decided: claimed.clone(),
                        claimed,
                        locked,
                        folded,
                    };
                }
            }
            Action::Claim(w) | Action::ClaimWaiting(w) => {
                let claimed = self.claimable(&state);
                if state.workers.iter().any(|p| !matches!(p, Phase::Idle)) {
                    state.seen.concurrent_batches = true;
                }
                state.workers[w] = Phase::Claimed(claimed);
            }
            Action::Lock(w) => {
                let (claimed, mut order, mut locked) = match state.workers[w].clone() {
                    Phase::Claimed(claimed) => {
                        let order = self.lock_order(&claimed, w);
                        (claimed, order, Vec::new())
                    }
                    Phase::Locking {
                        claimed,
                        order,
                        locked,
                    } => (claimed, order, locked),
                    _ => return None,
                };
                if !order.is_empty() {
                    locked.push(order.remove(0));
                }
                state.workers[w] = if order.is_empty() {
                    let folded = locked
                        .iter()
                        .map(|&s| (s, state.db.semaphores[s].pending))
                        .filter(|(_, count)| *count > 0)
                        .collect();
                    Phase::Locked {
                        decided: claimed.clone(),
                        claimed,
                        locked,
                        folded,
                    }
                } else {
                    Phase::Locking {
                        claimed,
                        order,
                        locked,
                    }
                };
            }
            Action::Apply(w) => self.apply(&mut state, w),
            Action::Commit(w) => self.commit(&mut state, w),
            Action::Crash(w) => {
                if matches!(state.workers[w], Phase::Applied { .. }) {
                    state.seen.crashed_after_apply = true;
                }
                if self.plant == Some(Plant::ClaimNotReturnedOnCrash) {
                    let (mine, _) = Self::locks(&state, None);
                    let (others, _) = Self::locks(&state, Some(w));
                    let leaked: Vec<usize> = mine.difference(&others).copied().collect();
                    state.leaked_rows.extend(leaked);
                }
                state.workers[w] = Phase::Idle;
                state.crashes_left -= 1;
            }
            Action::SetCapacity => {
                let (s, capacity) = self.capacity_change?;
                Self::committing(&mut state);
                state.db.semaphores[s].capacity = capacity;
                state.capacity_change_left = false;
            }
            Action::Failover => {
                // Every open transaction is lost with the old primary.
                state.workers = vec![Phase::Idle; self.workers];
                state.sweep_selected.clear();
                if self.failover == Some(Replication::Asynchronous) {
                    if let Some(standby) = state.before_last_commit.take() {
                        state.db = *standby;
                    }
                }
                // A new timeline: the workers raise the token epoch before granting.
                if self.plant != Some(Plant::NoEpochRaise) {
                    state.db.epoch += 1;
                }
                state.before_last_commit = None;
                state.failover_left = false;
                state.seen.failed_over = true;
            }
        }
        self.check_rows(&mut state);
        Some(state)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(
                "no step broke a rule (capacity, tokens, one grant, one-way, reserve)",
                |_: &GrantProtocol, s: &SystemState| s.violation.is_none(),
            ),
            Property::always(
                "used counts exactly the permits held and the releases not folded",
                |m: &GrantProtocol, s: &SystemState| {
                    (0..m.semaphores.len()).all(|i| {
                        let row = &s.db.semaphores[i];
                        row.used == GrantProtocol::held(&s.db, i) + row.pending
                    })
                },
            ),
            Property::always(
                "every grant took its count from what it names and each ancestor",
                |m: &GrantProtocol, s: &SystemState| {
                    s.db.requests.iter().enumerate().all(|(r, row)| {
                        row.state != RequestState::Acquired
                            || row.charged == m.takes(r).into_iter().collect::<Vec<_>>()
                    })
                },
            ),
            Property::always(
                "tokens grow in grant order on each semaphore",
                |m: &GrantProtocol, s: &SystemState| {
                    s.db.grants.iter().enumerate().all(|(i, (r, t))| {
                        s.db.grants[i + 1..]
                            .iter()
                            .all(|(later, u)| t < u || !m.share_a_semaphore(*r, *later))
                    })
                },
            ),
            Property::always(
                "once nothing can happen, no request is left new",
                |m: &GrantProtocol, s: &SystemState| {
                    s.violation.is_some()
                        || !m.quiescent(s)
                        || s.db.requests.iter().all(|r| r.state != RequestState::New)
                },
            ),
            Property::always(
                "no request is stuck: with nothing held and every worker idle, one that waits \
                 can be granted",
                |m: &GrantProtocol, s: &SystemState| s.violation.is_some() || !m.stuck(s),
            ),
            Property::sometimes(
                "a request waited, then was granted",
                |_: &GrantProtocol, s: &SystemState| s.seen.waited_then_granted,
            ),
            Property::sometimes(
                "a grant borrowed at a parent (where something is nested)",
                |m: &GrantProtocol, s: &SystemState| {
                    s.seen.borrowed || m.semaphores.iter().all(|x| x.parent.is_none())
                },
            ),
            Property::sometimes(
                "two workers had batches open at once",
                |_: &GrantProtocol, s: &SystemState| s.seen.concurrent_batches,
            ),
            Property::sometimes(
                "a worker crashed after applying",
                |_: &GrantProtocol, s: &SystemState| s.seen.crashed_after_apply,
            ),
            Property::sometimes(
                "a grant after a failover",
                |_: &GrantProtocol, s: &SystemState| s.seen.granted_after_failover,
            ),
            Property::sometimes(
                "a worker skipped a semaphore another held (LockFirst only)",
                |m: &GrantProtocol, s: &SystemState| {
                    s.seen.skipped || m.lock_mode == LockMode::Wait
                },
            ),
            Property::sometimes(
                "a worker held part of a request's semaphores, another the rest (LockFirst, \
                 where nothing is nested)",
                |m: &GrantProtocol, s: &SystemState| {
                    s.seen.partly_held
                        || m.lock_mode == LockMode::Wait
                        || m.semaphores.iter().any(|x| x.parent.is_some())
                },
            ),
            Property::sometimes(
                "a heartbeat between the sweep's select and release kept the lease",
                |_: &GrantProtocol, s: &SystemState| s.seen.heartbeat_beat_the_sweep,
            ),
            Property::sometimes(
                "every request settled",
                |_: &GrantProtocol, s: &SystemState| {
                    s.db.requests
                        .iter()
                        .all(|r| matches!(r.state, RequestState::Released | RequestState::Error(_)))
                },
            ),
        ]
    }
}
