//! Planted bugs, to prove the checkers catch them: `permitq chaos --mutation NAME`.
//!
//! Each is a patch of one schema file of this build (`permitq::migrate::SCHEMA_FILES`), applied
//! at run time to the file's current text and run against the database under test (never the
//! product's): a mutation cannot drift from the function it breaks. When the text it patches is
//! no longer in the file, [`Mutation::sql`] fails, and so does the test that applies every
//! mutation.

use std::fmt;
use std::str::FromStr;

/// A planted bug.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mutation {
    /// The worker's semaphore rows are read without FOR UPDATE (and the apply's capacity check
    /// is off).
    NoSemaphoreLock,
    /// The fold gives released capacity back twice.
    FoldTwice,
    /// Releasing an already released request gives its permits back again.
    DoubleRelease,
    /// Grants ignore fairness: every semaphore is treated as greedy.
    SkipFairness,
    /// Rate-limited semaphores are decided on their holders, not their window.
    IgnoreWindow,
    /// The claim skips every request whose id ends in 7: they are never examined.
    NeverClaimed,
    /// A grant of a request whose id ends in 3 is dropped from the batch's write, as if rolled
    /// back, every time: the request is lost in `new`.
    LostRequest,
    /// The lease sweep releases nothing: leases never expire.
    LeasesNeverExpire,
    /// The token sequence cycles through 40 values, and the grant's check for a sequence behind
    /// an issued token is off: grants collide on the unique token index.
    TokensReused,
    /// Some grant batches draw tokens without the epoch's high bits: a token below an earlier
    /// one.
    TokensBackwards,
    /// The claim takes granted requests again and the grant overwrites them: a second grant
    /// of one request.
    GrantTwice,
    /// The claim never reconsiders a waiter that needs more than one permit: such a head
    /// starves.
    StarveHead,
    /// A grant on a nested semaphore is counted on the semaphores it names only, not on their
    /// ancestors: a parent's capacity stops binding.
    ParentNotCharged,
    /// A heartbeat is confirmed but leaves `expires_at` where it was: the guard believes the
    /// lease extended, the sweep reclaims it under a holder still working.
    HeartbeatNotExtended,
    /// `permitq.fence` accepts the token of a lease that ran out until the sweep releases it.
    FenceAfterExpiry,
    /// A grant counts in the window of a rate-limited semaphore only when it names it, not
    /// through a child: a parent's rate limit stops binding.
    ParentWindowNotCharged,
    /// The guaranteed children a batch reads without locking them are read with guarantee 0:
    /// borrowers at their parent take the share kept for them.
    ReserveDropped,
    /// The claim's room on a semaphore whose capacity was lowered below what is held is used
    /// as a LIMIT unclamped: below zero, every pass fails while a request waits there.
    NegativeRoom,
    /// On a keyed semaphore, every request is tagged as if it had no fairness key: one line in
    /// arrival order, whatever the tenants.
    KeysIgnored,
}

/// One replacement in a schema file: `find` must occur exactly once.
struct Patch {
    find: &'static str,
    replace: &'static str,
}

/// How a bug is planted.
enum Plant {
    /// Patches of the current text of one schema file, which is then run.
    File(&'static str, &'static [Patch]),
    /// The same for two files.
    Files([(&'static str, &'static [Patch]); 2]),
    /// Patches of one schema file, then a statement.
    FileThen(&'static str, &'static [Patch], &'static str),
}

impl Mutation {
    /// Every mutation.
    pub(crate) const ALL: [Mutation; 19] = [
        Mutation::NoSemaphoreLock,
        Mutation::FoldTwice,
        Mutation::DoubleRelease,
        Mutation::SkipFairness,
        Mutation::IgnoreWindow,
        Mutation::NeverClaimed,
        Mutation::LostRequest,
        Mutation::LeasesNeverExpire,
        Mutation::TokensReused,
        Mutation::TokensBackwards,
        Mutation::GrantTwice,
        Mutation::StarveHead,
        Mutation::ParentNotCharged,
        Mutation::HeartbeatNotExtended,
        Mutation::FenceAfterExpiry,
        Mutation::ParentWindowNotCharged,
        Mutation::ReserveDropped,
        Mutation::NegativeRoom,
        Mutation::KeysIgnored,
    ];

    /// How it is planted.
    fn plant(self) -> Plant {
        let (path, patches) = match self {
            Mutation::TokensReused => {
                // And the grant's own check for a sequence behind a token already issued
                // (which would raise the epoch past the reuse) is off.
                return Plant::FileThen(
                    "fencing_tokens.sql",
                    &[Patch {
                        find: "        OR ((recorded.epoch + greatest(current_timeline - recorded.timeline, 0)) << 48)",
                        replace: "        OR false AND ((recorded.epoch + greatest(current_timeline - recorded.timeline, 0)) << 48)",
                    }],
                    "ALTER SEQUENCE permitq.fencing_token_seq MAXVALUE 40 CYCLE",
                );
            }
            Mutation::GrantTwice => {
                return Plant::Files([
                    (
                        "claim.sql",
                        &[Patch {
                            find: "WHERE r.state = 'new' AND NOT r.examined\n      AND permitq.rule_place_in_line(r.priority, r.created_at) < cursor",
                            replace: "WHERE r.state IN ('new', 'acquired') AND NOT r.examined\n      AND permitq.rule_place_in_line(r.priority, r.created_at) < cursor",
                        }],
                    ),
                    (
                        "decision_outcome.sql",
                        &[Patch {
                            find: "            WHERE r.id = g.id AND r.state = 'new'\n",
                            replace: "            WHERE r.id = g.id\n",
                        }],
                    ),
                ])
            }
            Mutation::NeverClaimed => (
                "claim.sql",
                &[Patch {
                    find: "WHERE r.state = 'new' AND NOT r.examined\n      AND permitq.rule_place_in_line(r.priority, r.created_at) < cursor",
                    replace: "WHERE r.state = 'new' AND NOT r.examined AND r.id % 10 <> 7\n      AND permitq.rule_place_in_line(r.priority, r.created_at) < cursor",
                }][..],
            ),
            Mutation::StarveHead => (
                "claim.sql",
                &[Patch {
                    find: "WHERE room.free > 0 AND w.count <= room.free\n",
                    replace: "WHERE room.free > 0 AND w.count <= room.free AND w.count = 1\n",
                }][..],
            ),
            Mutation::LostRequest => (
                "decision_outcome.sql",
                &[Patch {
                    find: "            FROM unnest(granted) WITH ORDINALITY AS g(id, n)\n",
                    replace: "            FROM unnest(granted) WITH ORDINALITY AS g(id, n) WHERE g.id % 10 <> 3\n",
                }][..],
            ),
            Mutation::ParentNotCharged => (
                "decision_outcome.sql",
                &[Patch {
                    find: "                charged = charges -> r.id::text\n",
                    replace: "                charged = NULL\n",
                }][..],
            ),
            Mutation::HeartbeatNotExtended => (
                "heartbeat.sql",
                &[Patch {
                    find: "SET expires_at = new_expiry, heartbeat_at = now()",
                    replace: "SET expires_at = r.expires_at, heartbeat_at = now()",
                }][..],
            ),
            Mutation::FenceAfterExpiry => (
                "fence.sql",
                &[Patch {
                    find: "AND CASE WHEN r.expires_at IS NULL OR r.expires_at > now() THEN true",
                    replace: "AND CASE WHEN true THEN true",
                }][..],
            ),
            Mutation::ParentWindowNotCharged => (
                "decision_outcome.sql",
                &[Patch {
                    find: "            WHERE s.per IS NOT NULL\n            GROUP BY 1, 2\n",
                    replace: "            WHERE s.per IS NOT NULL AND EXISTS (SELECT 1 FROM permitq.permit_request q\n                                                WHERE q.id = done.id AND q.permits ? s.name)\n            GROUP BY 1, 2\n",
                }][..],
            ),
            Mutation::ReserveDropped => (
                "batch_semaphores.sql",
                &[Patch {
                    find: "           c.fair, c.parent, c.guarantee,\n",
                    replace: "           c.fair, c.parent, 0,\n",
                }][..],
            ),
            Mutation::NegativeRoom => (
                "claim.sql",
                &[Patch {
                    find: "LIMIT greatest(least(batch_size, room.free), 0)",
                    replace: "LIMIT least(batch_size, room.free)",
                }][..],
            ),
            Mutation::LeasesNeverExpire => (
                "sweeps.sql",
                &[Patch {
                    find: "SELECT coalesce(permitq.release_locked(array_agg(id), 'expired'), 0)",
                    replace: "SELECT (0 * count(*))::integer",
                }][..],
            ),
            Mutation::TokensBackwards => (
                "fencing_tokens.sql",
                &[Patch {
                    find: "    RETURN epoch_now << 48;",
                    replace: "    RETURN CASE WHEN random() < 0.3 THEN 0 ELSE epoch_now << 48 END;",
                }][..],
            ),
            Mutation::NoSemaphoreLock => {
                // And without the apply's own capacity check, which would refuse what the
                // unlocked decisions over-grant.
                return Plant::Files([
                    (
                        "batch_semaphores.sql",
                        &[
                            Patch {
                                find: "        ORDER BY s.id\n        FOR UPDATE\n    ) l;",
                                replace: "        ORDER BY s.id\n    ) l;",
                            },
                            Patch {
                                find: "        ORDER BY s.id\n        FOR UPDATE OF s SKIP LOCKED\n    ) l;",
                                replace: "        ORDER BY s.id\n    ) l;",
                            },
                        ],
                    ),
                    (
                        "decision_outcome.sql",
                        &[Patch {
                            find: "IF over_capacity IS NOT NULL THEN",
                            replace: "IF false THEN",
                        }],
                    ),
                ]);
            }
            Mutation::KeysIgnored => (
                "fairness.sql",
                &[Patch {
                    find: "SELECT r.id, coalesce(r.fairness_key, '') AS fkey, r.place",
                    replace: "SELECT r.id, ''::text AS fkey, r.place",
                }][..],
            ),
            Mutation::SkipFairness => (
                "batch_semaphores.sql",
                &[Patch {
                    find: "           s.fair, s.parent, s.guarantee,\n           s.guarantee > 0\n",
                    replace: "           false, s.parent, s.guarantee,\n           s.guarantee > 0\n",
                }][..],
            ),
            Mutation::FoldTwice => (
                "batch_semaphores.sql",
                &[Patch {
                    find: "SET used = s.used - t.total,",
                    // Floored at 0, so the CHECK on `used` does not stop it.
                    replace: "SET used = greatest(s.used - 2 * t.total, 0),",
                }][..],
            ),
            Mutation::IgnoreWindow => {
                // And without the apply's own window check, which would refuse what the
                // decisions over-grant.
                return Plant::Files([
                    (
                        "batch_semaphores.sql",
                        &[Patch {
                            find: "CASE WHEN s.per IS NULL THEN s.used ELSE permitq.in_window(s) END",
                            replace: "s.used",
                        }],
                    ),
                    (
                        "decision_outcome.sql",
                        &[Patch {
                            find: "              AND permitq.in_window(s) > s.capacity;",
                            replace: "              AND false;",
                        }],
                    ),
                ]);
            }
            Mutation::DoubleRelease => (
                "release.sql",
                &[Patch {
                    find: "        WHEN 'released' THEN\n            RETURN 'already_released';",
                    replace: "        WHEN 'released' THEN
            INSERT INTO permitq.pending_release (request_id, semaphore, count, announce)
            SELECT request.id, e.key, e.value::int, false FROM jsonb_each(request.permits) e;
            PERFORM permitq.wake_workers();
            RETURN 'released';",
                }][..],
            ),
        };
        Plant::File(path, patches)
    }

    /// The SQL that plants it: its schema files with the patches applied (or its statement).
    pub(crate) fn sql(self) -> Result<String, String> {
        match self.plant() {
            Plant::FileThen(path, patches, statement) => {
                Ok(format!("{}\n{statement}", self.patched(path, patches)?))
            }
            Plant::File(path, patches) => self.patched(path, patches),
            Plant::Files(files) => Ok(format!(
                "{}\n{}",
                self.patched(files[0].0, files[0].1)?,
                self.patched(files[1].0, files[1].1)?
            )),
        }
    }

    /// Schema file `path` with `patches` applied to its current text.
    fn patched(self, path: &str, patches: &[Patch]) -> Result<String, String> {
        let file = permitq::migrate::schema_file(path)
            .ok_or_else(|| format!("mutation {self}: no schema file {path}"))?;
        let mut sql = file.sql.to_string();
        for patch in patches {
            let found = sql.matches(patch.find).count();
            if found != 1 {
                return Err(format!(
                    "mutation {self} no longer applies: schema/functions/{path} has {found} \
                     copies of the text it replaces (needs exactly 1): {:?}",
                    patch.find
                ));
            }
            sql = sql.replacen(patch.find, patch.replace, 1);
        }
        Ok(sql)
    }

    /// The name used on the command line.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Mutation::NoSemaphoreLock => "no-semaphore-lock",
            Mutation::FoldTwice => "fold-twice",
            Mutation::DoubleRelease => "double-release",
            Mutation::SkipFairness => "skip-fairness",
            Mutation::IgnoreWindow => "ignore-window",
            Mutation::NeverClaimed => "never-claimed",
            Mutation::LostRequest => "lost-request",
            Mutation::LeasesNeverExpire => "leases-never-expire",
            Mutation::TokensReused => "tokens-reused",
            Mutation::TokensBackwards => "tokens-backwards",
            Mutation::GrantTwice => "grant-twice",
            Mutation::StarveHead => "starve-head",
            Mutation::ParentNotCharged => "parent-not-charged",
            Mutation::HeartbeatNotExtended => "heartbeat-not-extended",
            Mutation::FenceAfterExpiry => "fence-after-expiry",
            Mutation::ParentWindowNotCharged => "parent-window-not-charged",
            Mutation::ReserveDropped => "reserve-dropped",
            Mutation::NegativeRoom => "negative-room",
            Mutation::KeysIgnored => "keys-ignored",
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
            .ok_or_else(|| {
                let names: Vec<&str> = Mutation::ALL.iter().map(|m| m.name()).collect();
                format!("unknown mutation {s:?}: one of {}", names.join(", "))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::Mutation;

    /// A mutation whose text left its function fails here, not silently in a chaos run.
    #[test]
    fn every_mutation_applies_to_the_current_schema_files() {
        for m in Mutation::ALL {
            let sql = m.sql().unwrap_or_else(|e| panic!("{e}"));
            if let super::Plant::File(path, _) = m.plant() {
                let original = permitq::migrate::schema_file(path).unwrap().sql;
                assert_ne!(sql, original, "{m} changes {path}");
            }
            assert!(!sql.is_empty(), "{m}");
        }
    }
}
