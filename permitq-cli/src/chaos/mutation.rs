//! Planted bugs, to prove the checkers catch them. Each replaces a schema function of the
//! database under test (never of the product): `permitq chaos --mutation NAME`.

use std::fmt;
use std::str::FromStr;

use crate::error::Result;

/// A planted bug.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mutation {
    /// The worker's semaphore rows are read without FOR UPDATE.
    NoSemaphoreLock,
    /// The lease sweep gives capacity back with an unlocked read-modify-write of `used`.
    SweepWithoutLock,
    /// Releasing an already released request decrements `used` again.
    DoubleRelease,
    /// Grants ignore fairness: every semaphore is treated as greedy.
    SkipFairness,
}

impl Mutation {
    /// Every mutation.
    pub(crate) const ALL: [Mutation; 4] = [
        Mutation::NoSemaphoreLock,
        Mutation::SweepWithoutLock,
        Mutation::DoubleRelease,
        Mutation::SkipFairness,
    ];

    /// The SQL that plants it.
    pub(crate) fn sql(self) -> &'static str {
        match self {
            Mutation::NoSemaphoreLock => {
                "CREATE OR REPLACE FUNCTION permitq.lock_semaphores(names text[])
                 RETURNS TABLE (id bigint, name text, capacity integer, used integer, fair boolean)
                 LANGUAGE sql AS $$
                     SELECT s.id, s.name, s.capacity, s.used, s.fair FROM permitq.semaphore s
                     WHERE s.name = ANY(names) ORDER BY s.id
                 $$;"
            }
            Mutation::SkipFairness => {
                "CREATE OR REPLACE FUNCTION permitq.lock_semaphores(names text[])
                 RETURNS TABLE (id bigint, name text, capacity integer, used integer, fair boolean)
                 LANGUAGE sql AS $$
                     SELECT s.id, s.name, s.capacity, s.used, false FROM permitq.semaphore s
                     WHERE s.name = ANY(names) ORDER BY s.id FOR UPDATE
                 $$;"
            }
            Mutation::SweepWithoutLock => {
                // Reads `used` without the semaphore lock, takes a while (a slow sweep), then
                // writes back what it computed: a lost update whenever a grant commits between.
                "CREATE OR REPLACE FUNCTION permitq.sweep_expired(batch_size integer) RETURNS integer
                 LANGUAGE plpgsql AS $$
                 DECLARE
                     ids bigint[];
                     names text[];
                     totals bigint[];
                     seen integer[];
                 BEGIN
                     SELECT array_agg(id) INTO ids FROM (
                         SELECT id FROM permitq.permit_request
                         WHERE state = 'acquired' AND expires_at <= now()
                         LIMIT batch_size FOR UPDATE SKIP LOCKED) due;
                     IF ids IS NULL THEN RETURN 0; END IF;
                     SELECT array_agg(t.semaphore), array_agg(t.total), array_agg(s.used)
                     INTO names, totals, seen
                     FROM (SELECT semaphore, sum(count) AS total FROM permitq.permit
                           WHERE request_id = ANY(ids) AND state = 'acquired' GROUP BY semaphore) t
                     JOIN permitq.semaphore s ON s.name = t.semaphore;
                     PERFORM pg_sleep(0.05);
                     UPDATE permitq.semaphore s SET used = greatest(x.seen - x.total, 0)
                     FROM unnest(names, totals, seen) AS x(name, total, seen) WHERE s.name = x.name;
                     UPDATE permitq.permit SET state = 'released', released_at = clock_timestamp()
                     WHERE request_id = ANY(ids) AND state = 'acquired';
                     UPDATE permitq.permit_request SET state = 'released', release_reason = 'expired',
                         released_at = clock_timestamp(), settled_at = clock_timestamp()
                     WHERE id = ANY(ids);
                     PERFORM pg_notify('permitq_work', '');
                     RETURN array_length(ids, 1);
                 END $$;"
            }
            Mutation::DoubleRelease => {
                "CREATE OR REPLACE FUNCTION permitq.release_request(external_id text, reason text) RETURNS text
                 LANGUAGE plpgsql AS $$
                 DECLARE
                     request permitq.permit_request;
                 BEGIN
                     SELECT * INTO request FROM permitq.permit_request r WHERE r.external_id = $1 FOR UPDATE;
                     IF NOT FOUND THEN RETURN 'unknown'; END IF;
                     IF request.state IN ('acquired', 'released') THEN
                         PERFORM 1 FROM permitq.semaphore s
                         WHERE s.name IN (SELECT p.semaphore FROM permitq.permit p WHERE p.request_id = request.id)
                         ORDER BY s.id FOR UPDATE;
                         UPDATE permitq.semaphore s SET used = greatest(s.used - p.count, 0)
                         FROM permitq.permit p WHERE p.request_id = request.id AND s.name = p.semaphore;
                         UPDATE permitq.permit p SET state = 'released', released_at = coalesce(p.released_at, clock_timestamp())
                         WHERE p.request_id = request.id;
                         UPDATE permitq.permit_request r SET state = 'released',
                             release_reason = coalesce(r.release_reason, reason),
                             released_at = coalesce(r.released_at, clock_timestamp()),
                             settled_at = coalesce(r.settled_at, clock_timestamp())
                         WHERE r.id = request.id;
                         PERFORM pg_notify('permitq_work', '');
                         RETURN 'released';
                     ELSIF request.state = 'new' THEN
                         UPDATE permitq.permit_request r SET state = 'error', error_code = 'cancelled',
                             settled_at = clock_timestamp() WHERE r.id = request.id;
                         RETURN 'cancelled';
                     END IF;
                     RETURN 'not_acquired';
                 END $$;"
            }
        }
    }

    /// The name used on the command line.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Mutation::NoSemaphoreLock => "no-semaphore-lock",
            Mutation::SweepWithoutLock => "sweep-without-lock",
            Mutation::DoubleRelease => "double-release",
            Mutation::SkipFairness => "skip-fairness",
        }
    }
}

impl fmt::Display for Mutation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Mutation {
    type Err = String;
    fn from_str(s: &str) -> Result<Mutation, String> {
        Mutation::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| format!("unknown mutation {s:?}: one of no-semaphore-lock, sweep-without-lock, double-release, skip-fairness"))
    }
}
