//! The fault-injection suite: a short seeded chaos run passes every checker with every fault
//! injected, and each planted bug makes the checker that guards against it fail, on a seed whose
//! unmutated run passes.
//!
//! The HA chaos mode (`--ha`) is run by hand (docs/chaos.md); in the suite, Patroni failover
//! and switchover under load are `permitq/tests/it/patroni.rs`.
//!
//! The long runs are `permitq chaos --network --duration 10m --seed N` and `permitq chaos --ha
//! --etcd-members 3 --duration 10m --seed N` (see docs/chaos.md).

use std::collections::BTreeMap;
use std::process::{Command, Output, Stdio};

fn chaos(args: &[&str]) -> (Output, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_permitq"))
        .arg("chaos")
        .args(args)
        .env_remove("DATABASE_URL")
        .stdin(Stdio::null())
        .output()
        .expect("run permitq chaos");
    let summary = String::from_utf8_lossy(&out.stdout).to_string();
    (out, summary)
}

/// The "violations by checker" table of a summary: checker → count.
fn violations(summary: &str) -> BTreeMap<String, u64> {
    summary
        .lines()
        .skip_while(|l| !l.starts_with("violations by checker"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter(|l| !l.starts_with("      "))
        .filter_map(|l| {
            let (name, n) = l.trim().rsplit_once(' ')?;
            Some((name.trim().to_string(), n.parse().ok()?))
        })
        .collect()
}

#[test]
fn a_short_seeded_chaos_run_with_every_fault_passes_every_checker() {
    // On the bed of network namespaces, so the network faults are in the schedule too.
    let summary = passing_run(&[
        "--network",
        "--duration",
        "75s",
        "--fault-every",
        "7s",
        "--seed",
        "42",
    ]);
    let faults = faults_line(&summary);
    for kind in [
        "KillWorker",
        "PauseHolder",
        "TerminateConnections",
        "RestartDatabase",
        "LowerCapacity",
        "TimeoutBurst",
        "Partition",
        "SlowLink",
    ] {
        assert!(
            fault_count(faults, kind) >= 1,
            "{kind} was not injected: {faults}"
        );
    }
    // The stale holder's writes (between its lease's end and the sweep, and after the sweep)
    // and the new holder's are all checked, every time.
    let pauses = fault_count(faults, "PauseHolder");
    let fence_checks: u32 = summary
        .lines()
        .find(|l| l.starts_with("fence "))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|n| n.parse().ok())
        .expect("fence operations line");
    assert!(
        fence_checks >= 3 * pauses,
        "{fence_checks} fence checks for {pauses} paused holders: {summary}"
    );
    assert!(summary.contains("result: PASS"), "{summary}");
}

/// Runs `permitq chaos ARGS` and checks that it passed: exit 0, every checker reported, none
/// found anything. Returns the summary.
fn passing_run(args: &[&str]) -> String {
    let (out, summary) = chaos(args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{summary}\n{stderr}");
    let found = violations(&summary);
    assert_eq!(found.len(), CHECKERS, "every checker reported: {summary}");
    assert!(found.values().all(|n| *n == 0), "{summary}");
    summary
}

/// How many checkers a summary reports.
const CHECKERS: usize = 13;

/// The summary's "faults injected:" line.
fn faults_line(summary: &str) -> &str {
    summary
        .lines()
        .find(|l| l.starts_with("faults injected:"))
        .expect("faults line")
}

/// How many faults of `kind` the "faults injected:" line counts.
fn fault_count(faults: &str, kind: &str) -> u32 {
    faults
        .split(kind)
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// The load every planted bug runs under: no faults, 12 clients, 25 s, this seed.
const PLANTED_LOAD: [&str; 7] = [
    "--duration",
    "25s",
    "--no-faults",
    "--clients",
    "12",
    "--seed",
    "11",
];

/// [`PLANTED_LOAD`] for longer, for bugs that show only when two things coincide (or a head is
/// first in line late, see `chaos_catches_a_starved_head`): several grants
/// through a rate-limited parent's children landing in one window (one to three times in 25 s on
/// a quiet machine, at times none under a busy CI's load), and two workers deciding on one full
/// semaphore at the same moment (rarer since the grant path's statements plan once: a batch is
/// shorter, so unlocked decisions overlap less; a CI run saw none in 25 s once).
const PLANTED_LOAD_LONGER: [&str; 7] = [
    "--duration",
    "45s",
    "--no-faults",
    "--clients",
    "12",
    "--seed",
    "11",
];

/// [`PLANTED_LOAD`] with the local faults, one every 3 s (each kind within the first six):
/// for the bugs only a fault exposes.
const PLANTED_LOAD_WITH_FAULTS: [&str; 8] = [
    "--duration",
    "25s",
    "--fault-every",
    "3s",
    "--clients",
    "12",
    "--seed",
    "11",
];

#[test]
fn the_load_of_the_planted_bugs_passes_without_them() {
    for args in [
        PLANTED_LOAD.to_vec(),
        [&PLANTED_LOAD[..], &["--workers", "6"]].concat(),
        PLANTED_LOAD_WITH_FAULTS.to_vec(),
    ] {
        let (out, summary) = chaos(&args);
        assert_eq!(out.status.code(), Some(0), "{args:?}: {summary}");
        let found = violations(&summary);
        assert_eq!(found.len(), CHECKERS, "every checker reported: {summary}");
        assert!(found.values().all(|n| *n == 0), "{args:?}: {summary}");
        assert!(
            key_moves(&summary) > 0,
            "the keys rule replayed nothing: {summary}"
        );
    }
}

/// How many moves of a key's finish tag the keys rule replayed.
fn key_moves(summary: &str) -> u64 {
    summary
        .lines()
        .find_map(|l| l.strip_prefix("fairness keys: "))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// Runs [`PLANTED_LOAD`] with a planted bug (and these extra arguments) and returns the
/// violations found by checker, and the summary with every violation's message.
fn planted(mutation: &str, extra: &[&str]) -> (BTreeMap<String, u64>, String) {
    planted_under(&PLANTED_LOAD, mutation, extra)
}

/// [`planted`] under the load `load`.
fn planted_under(load: &[&str], mutation: &str, extra: &[&str]) -> (BTreeMap<String, u64>, String) {
    let mut args = load.to_vec();
    args.extend(["--mutation", mutation]);
    args.extend_from_slice(extra);
    let (out, summary) = chaos(&args);
    assert_eq!(
        out.status.code(),
        Some(1),
        "the planted bug {mutation} went unnoticed:\n{summary}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stderr)
            .lines()
            .filter(|l| l.contains("WARN") || l.contains("ERROR"))
            .take(40)
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert!(summary.contains("result: FAIL"));
    // The summary, and every violation (printed on stderr).
    let all = format!("{summary}\n{}", String::from_utf8_lossy(&out.stderr));
    (violations(&summary), all)
}

#[test]
fn chaos_catches_a_grant_without_the_semaphore_lock() {
    // Over capacity needs two workers deciding on one semaphore at the same moment: with eight
    // of them that happens several times in 45 s even on a loaded box (with six, and a batch's
    // claim, lock and heads in one round trip, it did not in two runs of four).
    let (found, summary) = planted_under(
        &PLANTED_LOAD_LONGER,
        "no-semaphore-lock",
        &["--workers", "8"],
    );
    assert!(found["safety"] > 0, "{summary}");
}

#[test]
fn chaos_catches_a_fold_that_gives_released_capacity_back_twice() {
    let (found, summary) = planted("fold-twice", &[]);
    assert!(found["sampler"] > 0 && found["safety"] > 0, "{summary}");
}

#[test]
fn chaos_catches_a_double_release_that_decrements_twice() {
    let (found, summary) = planted("double-release", &[]);
    // The second `released` is in the history, when a holder releases twice before the damage
    // stops the queue: its capacity, given back again, takes `used` below 0 at the next fold,
    // the CHECK on `used` fails every batch, and the requests end `invalid` (outcomes).
    assert!(found["history"] + found["outcomes"] > 0, "{summary}");
}

#[test]
fn chaos_catches_a_grant_that_skips_the_fairness_check() {
    let (found, summary) = planted("skip-fairness", &[]);
    assert!(found["fairness"] > 0, "{summary}");
}

/// The fairness rule extended to keys: a worker that tags every request on a keyed semaphore as
/// if it had no key (one line in arrival order) moves the wrong keys' finish tags.
#[test]
fn chaos_catches_a_keyed_semaphore_that_ignores_fairness_keys() {
    let (found, summary) = planted("keys-ignored", &[]);
    assert!(found["fairness"] > 0, "{summary}");
    assert!(summary.contains("keys: c-keyed"), "{summary}");
}

#[test]
fn chaos_catches_grants_past_a_rate_limit() {
    let (found, summary) = planted("ignore-window", &[]);
    assert!(found["safety"] > 0, "{summary}");
}

#[test]
fn chaos_catches_requests_that_are_never_claimed() {
    let (found, summary) = planted("never-claimed", &[]);
    assert!(found["liveness"] > 0, "{summary}");
    assert!(summary.contains("never examined by a worker"), "{summary}");
}

#[test]
fn chaos_catches_a_request_lost_in_new() {
    // The lost requests are examined (they queue behind one another) before their grant is
    // lost, so whether a liveness bound also runs out within the load depends on the timing;
    // the end state never lies.
    let (found, summary) = planted("lost-request", &[]);
    assert!(found["nothing lost"] > 0, "{summary}");
    assert!(summary.contains("still new at the end"), "{summary}");
}

#[test]
fn chaos_catches_leases_that_never_expire() {
    let (found, summary) = planted("leases-never-expire", &[]);
    assert!(found["liveness"] > 0, "{summary}");
    assert!(summary.contains("lease held past its expiry"), "{summary}");
}

#[test]
fn chaos_catches_reused_fencing_tokens() {
    // A token drawn twice fails its batch, which is retried, never its requests: once the 40
    // values are taken, nothing more is granted.
    let (found, summary) = planted("tokens-reused", &[]);
    assert!(found["liveness"] > 0, "{summary}");
}

#[test]
fn chaos_catches_a_fencing_token_below_an_earlier_one() {
    let (found, summary) = planted("tokens-backwards", &[]);
    assert!(found["fencing"] > 0, "{summary}");
}

#[test]
fn chaos_catches_a_request_granted_twice() {
    let (found, summary) = planted("grant-twice", &[]);
    assert!(found["no double grant"] > 0, "{summary}");
}

/// A pass failing on a program error while a capacity is lowered below what is held (the
/// LowerCapacity fault, with waiters there) stalls every semaphore of the worker: the `passes`
/// checker reads it from the workers' logs.
#[test]
fn chaos_catches_passes_that_fail_while_a_capacity_is_lowered() {
    let (found, summary) = planted_under(&PLANTED_LOAD_WITH_FAULTS, "negative-room", &[]);
    assert!(found["passes"] > 0, "{summary}");
    assert!(summary.contains("(SQLSTATE 2201W)"), "{summary}");
}

/// Under the longer load: a starved head that also names the greedy `c-d` is judged only once
/// `c-d` has had room for a span after the head bound, and the heads behind an unjudged one
/// wait for it; in 25 s a busy CI run once saw every starved head go unjudged that way (the
/// `nothing lost` checker fired, not liveness).
#[test]
fn chaos_catches_a_starved_head() {
    let (found, summary) = planted_under(&PLANTED_LOAD_LONGER, "starve-head", &[]);
    assert!(found["liveness"] > 0, "{summary}");
    assert!(summary.contains("a starved head"), "{summary}");
}

#[test]
fn chaos_catches_a_grant_that_does_not_take_from_the_parent() {
    // The checkers work out what each level holds from what the requests name and the tree,
    // not from what permitq recorded a grant took: the sampler sees the pool's `used` below
    // what is held under it, and its `granted` counter below the grants through its tenants.
    // (Whether the pool is also overfilled depends on the tenants' demand in the run: *safety*
    // catches that when it happens.)
    let (found, summary) = planted("parent-not-charged", &[]);
    assert!(
        found["sampler"] > 0 && found["no double grant"] > 0,
        "{summary}"
    );
    assert!(summary.contains("c-pool: used 0 under-counts"), "{summary}");
}

#[test]
fn chaos_catches_a_holder_working_past_a_lease_its_heartbeats_did_not_extend() {
    // Holders under the Lease guard work up to 2.5 TTLs; the guard believes each confirmed
    // heartbeat, the sweep does not.
    let (found, summary) = planted("heartbeat-not-extended", &[]);
    assert!(found["leases"] > 0, "{summary}");
    assert!(summary.contains("past the end of its lease"), "{summary}");
}

#[test]
fn chaos_catches_a_fence_that_accepts_a_lease_run_out_before_the_sweep() {
    // The pause-holder fault offers the paused holder's token between its lease's end and the
    // sweep (the sweep is kept off its row meanwhile).
    let (found, summary) = planted_under(&PLANTED_LOAD_WITH_FAULTS, "fence-after-expiry", &[]);
    assert!(found["fencing"] > 0, "{summary}");
    assert!(summary.contains("had run out (not swept yet)"), "{summary}");
}

#[test]
fn chaos_catches_a_parent_whose_rate_window_is_not_charged_through_its_children() {
    let (found, summary) = planted_under(&PLANTED_LOAD_LONGER, "parent-window-not-charged", &[]);
    assert!(found["safety"] > 0, "{summary}");
    assert!(summary.contains("c-rp: "), "{summary}");
}

#[test]
fn chaos_catches_borrowers_taking_a_guaranteed_childs_share() {
    let (found, summary) = planted("reserve-dropped", &[]);
    assert!(found["guarantees"] > 0, "{summary}");
}

/// The build users ran before the newest migration: the commit before the one that added it
/// (from this repository's git history), built once into `target/upgrade-previous/COMMIT/`
/// (its own target directory, kept between runs). Returns its `permitq` binary.
fn previous_build() -> std::path::PathBuf {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let git = |args: &[&str]| -> String {
        let out = Command::new("git")
            .args(args)
            .current_dir(&root)
            .output()
            .expect("git");
        assert!(
            out.status.success(),
            "git {args:?}: {} (the upgrade test needs the repository's history: a full clone, \
             or `git fetch --unshallow`)",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    let newest = std::fs::read_dir(root.join("permitq/schema/migrations"))
        .unwrap()
        .filter_map(|e| {
            let name = e.unwrap().file_name().into_string().ok()?;
            let version: u32 = name.strip_prefix('V')?.split("__").next()?.parse().ok()?;
            Some((version, name))
        })
        .max()
        .expect("migrations")
        .1;
    let added = git(&[
        "log",
        "-1",
        "--format=%H",
        "--diff-filter=A",
        "--",
        &format!("permitq/schema/migrations/{newest}"),
    ]);
    assert!(!added.is_empty(), "{newest} is not committed yet");
    let previous = git(&["rev-parse", "--short=12", &format!("{added}^")]);
    let dir = root.join("target/upgrade-previous").join(&previous);
    let binary = dir.join("target/debug/permitq");
    if binary.exists() {
        return binary;
    }
    let src = dir.join("src");
    let _ = std::fs::remove_dir_all(&src);
    std::fs::create_dir_all(&src).unwrap();
    let unpacked = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "git archive {previous} | tar -x -C '{}'",
            src.display()
        ))
        .current_dir(&root)
        .status()
        .unwrap();
    assert!(unpacked.success(), "git archive {previous}");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
    let built = Command::new(cargo)
        .args(["build", "-p", "permitq-cli", "--quiet", "--target-dir"])
        .arg(dir.join("target"))
        .current_dir(&src)
        .stdin(Stdio::null())
        .status()
        .unwrap();
    assert!(built.success(), "building {previous}");
    binary
}

/// A rolling upgrade under load across the newest migration: the previous build's schema and
/// three of its workers, this build's `migrate` a quarter in, then each worker replaced by this
/// build's (SIGTERM, as a rolling restart does) while the load runs. Old and new workers grant
/// side by side on the new schema: every checker passes, every step happened, and each old
/// worker stopped cleanly (exit 0) at its SIGTERM, not before.
#[test]
fn a_rolling_upgrade_across_the_newest_migration_keeps_every_guarantee() {
    let previous = previous_build();
    let summary = passing_run(&[
        "--previous",
        previous.to_str().unwrap(),
        "--no-faults",
        "--workers",
        "3",
        "--duration",
        "40s",
        "--seed",
        "5",
    ]);
    let faults = faults_line(&summary);
    assert_eq!(fault_count(faults, "Migrate"), 1, "{summary}");
    assert_eq!(fault_count(faults, "UpgradeWorker"), 3, "{summary}");
    assert!(!summary.contains("injection failed"), "{summary}");
}
