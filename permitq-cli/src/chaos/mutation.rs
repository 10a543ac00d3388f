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
    /// The fold gives released capacity back twice.
    FoldTwice,
    /// Releasing an already released request gives its permits back again.
    DoubleRelease,
    /// Grants ignore fairness: every semaphore is treated as greedy.
    SkipFairness,
    /// Rate-limited semaphores are decided on their holders, not their window.
    IgnoreWindow,
}

/// What the decision sees as `used`: the window for a rate-limited semaphore.
const USED: &str = "CASE WHEN s.per IS NULL THEN s.used ELSE permitq.in_window(s) END";

/// permitq.lock_and_fold as schema/V8__templates_rate_limits_priorities.sql defines it, with the
/// places a mutation changes: `{lock}`/`{lock_skip}` (FOR UPDATE), `{new_used}` (the fold),
/// `{used}` (what the decision sees) and `{fair}`.
const LOCK_AND_FOLD: &str = "CREATE OR REPLACE FUNCTION permitq.lock_and_fold(names text[])
RETURNS TABLE (id bigint, name text, capacity integer, used integer, fair boolean)
LANGUAGE plpgsql AS $$
DECLARE
    locked text[];
    also text[];
    announced bigint[];
BEGIN
    INSERT INTO permitq.semaphore (name, capacity, fair, template, per)
    SELECT n.name, t.capacity, t.fair, t.name, t.per
    FROM (SELECT DISTINCT x AS name FROM unnest(names) x) n
    CROSS JOIN LATERAL permitq.template_for(n.name) t
    WHERE t.name IS NOT NULL AND NOT EXISTS (SELECT 1 FROM permitq.semaphore s WHERE s.name = n.name)
    ORDER BY n.name
    ON CONFLICT ON CONSTRAINT semaphore_name_key DO NOTHING;
    SELECT array_agg(l.name) INTO locked FROM (
        SELECT s.name FROM permitq.semaphore s WHERE s.name = ANY(names) AND NOT s.is_template
        ORDER BY s.id {lock}
    ) l;
    SELECT array_agg(l.name) INTO also FROM (
        SELECT s.name FROM permitq.semaphore s
        WHERE s.name IN (SELECT p.semaphore FROM permitq.pending_release p WHERE p.semaphore IS NOT NULL)
          AND s.name <> ALL(coalesce(locked, '{}'))
        ORDER BY s.id {lock_skip}
    ) l;
    locked := coalesce(locked, '{}') || coalesce(also, '{}');
    WITH folded AS (
        {consume}
    ),
    give_back AS (
        UPDATE permitq.semaphore s SET used = {new_used}, updated_at = now()
        FROM (SELECT f.semaphore, sum(f.count) AS total FROM folded f
              WHERE f.semaphore IS NOT NULL GROUP BY f.semaphore) t
        WHERE s.name = t.semaphore
    )
    SELECT array_agg(f.request_id) FILTER (WHERE f.announce) INTO announced FROM folded f;
    IF announced IS NOT NULL THEN
        PERFORM permitq.notify_events(announced);
    END IF;
    RETURN QUERY SELECT s.id, s.name, s.capacity, {used}, {fair}
    FROM permitq.semaphore s WHERE s.name = ANY(names) AND NOT s.is_template ORDER BY s.id;
END $$;";

const CONSUME: &str = "DELETE FROM permitq.pending_release p
        WHERE p.semaphore = ANY(locked)
           OR p.id IN (SELECT c.id FROM permitq.pending_release c WHERE c.semaphore IS NULL FOR UPDATE SKIP LOCKED)
        RETURNING p.request_id, p.semaphore, p.count, p.announce";

/// The fold's new `used`: the released counts taken off once.
const GIVE_BACK: &str = "s.used - t.total";
/// Taken off twice (floored at 0, so the CHECK on `used` does not stop it).
const GIVE_BACK_TWICE: &str = "greatest(s.used - 2 * t.total, 0)";

/// permitq.release_request where a released request is released again.
const DOUBLE_RELEASE: &str =
    "CREATE OR REPLACE FUNCTION permitq.release_request(external_id text, reason text) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    request permitq.permit_request;
BEGIN
    SELECT * INTO request FROM permitq.permit_request r WHERE r.external_id = $1 FOR UPDATE;
    IF NOT FOUND THEN RETURN 'unknown'; END IF;
    IF request.state = 'acquired' THEN
        PERFORM permitq.release_locked(ARRAY[request.id], reason);
        RETURN 'released';
    ELSIF request.state = 'released' THEN
        INSERT INTO permitq.pending_release (request_id, semaphore, count, announce)
        SELECT request.id, e.key, e.value::int, false FROM jsonb_each(request.permits) e;
        PERFORM permitq.wake_workers();
        RETURN 'released';
    ELSIF request.state = 'new' THEN
        UPDATE permitq.permit_request r SET state = 'error', error_code = 'cancelled',
            settled_at = clock_timestamp() WHERE r.id = request.id;
        DELETE FROM permitq.waiter w WHERE w.request_id = request.id;
        INSERT INTO permitq.pending_release (request_id, announce) VALUES (request.id, true);
        PERFORM permitq.wake_workers();
        RETURN 'cancelled';
    END IF;
    RETURN 'not_acquired';
END $$;";

impl Mutation {
    /// Every mutation.
    pub(crate) const ALL: [Mutation; 5] = [
        Mutation::NoSemaphoreLock,
        Mutation::FoldTwice,
        Mutation::DoubleRelease,
        Mutation::SkipFairness,
        Mutation::IgnoreWindow,
    ];

    /// The SQL that plants it.
    pub(crate) fn sql(self) -> String {
        let lock_and_fold = |lock: &str, new_used: &str, fair: &str, used: &str| {
            let lock_skip = if lock.is_empty() {
                ""
            } else {
                "FOR UPDATE SKIP LOCKED"
            };
            LOCK_AND_FOLD
                .replace("{lock_skip}", lock_skip)
                .replace("{lock}", lock)
                .replace("{consume}", CONSUME)
                .replace("{new_used}", new_used)
                .replace("{used}", used)
                .replace("{fair}", fair)
        };
        match self {
            Mutation::NoSemaphoreLock => lock_and_fold("", GIVE_BACK, "s.fair", USED),
            Mutation::SkipFairness => lock_and_fold("FOR UPDATE", GIVE_BACK, "false", USED),
            Mutation::FoldTwice => lock_and_fold("FOR UPDATE", GIVE_BACK_TWICE, "s.fair", USED),
            Mutation::IgnoreWindow => lock_and_fold("FOR UPDATE", GIVE_BACK, "s.fair", "s.used"),
            Mutation::DoubleRelease => DOUBLE_RELEASE.to_string(),
        }
    }

    /// The name used on the command line.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Mutation::NoSemaphoreLock => "no-semaphore-lock",
            Mutation::FoldTwice => "fold-twice",
            Mutation::DoubleRelease => "double-release",
            Mutation::SkipFairness => "skip-fairness",
            Mutation::IgnoreWindow => "ignore-window",
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
            .ok_or_else(|| format!("unknown mutation {s:?}: one of no-semaphore-lock, fold-twice, double-release, skip-fairness, ignore-window"))
    }
}
