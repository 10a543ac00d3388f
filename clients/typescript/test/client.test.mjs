// The TypeScript client against a real PostgreSQL with real `permitq worker` processes.
//
//   DATABASE_URL=postgres://... PERMITQ_ADMIN_URL=... PERMITQ_OTHER_URL=... node --test test/
//
// DATABASE_URL: a producer login; PERMITQ_ADMIN_URL: an admin login (set_capacity, revoke);
// PERMITQ_OTHER_URL: a second producer login (ownership); PERMITQ_SUPER_URL: a superuser login on
// the same machine (stopping backends). Every test uses ids of its own.

import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import { getEventListeners } from "node:events";
import { after, before, describe, it } from "node:test";

import pg from "pg";

import * as permitq from "../dist/index.js";

const URL = process.env.DATABASE_URL;
const ADMIN_URL = process.env.PERMITQ_ADMIN_URL ?? URL;
const OTHER_URL = process.env.PERMITQ_OTHER_URL;
// A superuser login on the same machine, to stop the lease's backends.
const SUPER_URL = process.env.PERMITQ_SUPER_URL;
const newId = (prefix) => `${prefix}-${randomUUID().slice(0, 8)}`;
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

async function waitFor(condition, what, ms = 15_000) {
  const deadline = Date.now() + ms;
  while (Date.now() < deadline) {
    const value = await condition();
    if (value) return value;
    await sleep(50);
  }
  throw new Error(`not within ${ms} ms: ${what}`);
}

describe("permitq client", () => {
  const sem = newId("ts");
  let client;
  let admin;

  before(async () => {
    admin = new permitq.Client({ connectionString: ADMIN_URL });
    await admin.setCapacity(sem, 2);
    client = new permitq.Client({ connectionString: URL });
  });

  after(async () => {
    await client.end();
    await admin.end();
  });

  it("acquires one after another share one LISTEN connection, closed by end()", async () => {
    const own = new permitq.Client({ connectionString: URL });
    await (await own.acquire(newId("reuse"), { [sem]: 1 }, { timeoutMs: 15_000 })).release();
    const first = [...own.listeners];
    assert.equal(first.length, 1);
    for (let i = 0; i < 2; i++) {
      await (await own.acquire(newId("reuse"), { [sem]: 1 }, { timeoutMs: 15_000 })).release();
    }
    assert.deepEqual(own.listeners, first, "the same connection, not one per acquire");
    await own.end();
    assert.equal(own.listeners.length, 0);
  });

  it("confirms durability only where a standby could take the grant back", async () => {
    const own = new permitq.Client({ connectionString: URL });
    const confirmed = [];
    const confirm = own.confirmDurable.bind(own);
    own.confirmDurable = async (externalId, deadline) => {
      confirmed.push(externalId);
      await confirm(externalId, deadline);
    };
    // This server names no synchronous standbys: no barrier, no round trip for it.
    await (await own.acquire(newId("nobarrier"), { [sem]: 1 }, { timeoutMs: 15_000 })).release();
    assert.deepEqual(confirmed, []);
    // Where the status says a barrier is needed, the grant waits for it.
    const { SQL } = await import("../dist/sql.js");
    const statement = SQL.statusAndBarrier;
    SQL.statusAndBarrier = statement.replace(
      "current_setting('synchronous_standby_names') <> '' OR pg_is_in_recovery()", "true");
    assert.notEqual(SQL.statusAndBarrier, statement);
    const id = newId("barrier");
    try {
      await (await own.acquire(id, { [sem]: 1 }, { timeoutMs: 15_000 })).release();
    } finally {
      SQL.statusAndBarrier = statement;
      await own.end();
    }
    assert.deepEqual(confirmed, [id]);
  });

  it("explains what a fairness key did to the place", async () => {
    const keyed = newId("keyed");
    await admin.setCapacity(keyed, 1);
    const pool = new pg.Pool({ connectionString: ADMIN_URL });
    await pool.query("SELECT permitq.set_fairness_keys($1, true)", [keyed]);
    await pool.end();
    const hold = await client.acquire(newId("hold"), { [keyed]: 1 }, { ttlSeconds: 30, timeoutMs: 15_000 });
    try {
      const id = newId("keyed");
      await client.submit(id, { [keyed]: 1 }, { fairnessKey: "tenant-a" });
      await waitFor(async () => (await client.explain(id))?.semaphores[0]?.position, "examined");
      const said = (await client.explain(id)).semaphores[0].fairness;
      assert.ok(said?.startsWith("fairness key tenant-a, weight 1: placed at its arrival"), String(said));
      await client.release(id);
    } finally {
      await hold.release();
    }
  });

  it("carries a fairness key and weight with the request", async () => {
    const id = newId("keyed");
    const submitted = await client.submit(id, { [sem]: 1 }, { fairnessKey: "tenant-a", fairnessWeight: 3 });
    assert.equal(submitted.fairnessKey, "tenant-a");
    assert.equal(submitted.fairnessWeight, 3);
    assert.equal((await client.status(id)).fairnessKey, "tenant-a");
    await client.release(id);
    const bad = await client.submit(newId("keyed"), { [sem]: 1 }, { fairnessKey: "t", fairnessWeight: 0 }).catch((e) => e);
    assert.ok(bad instanceof permitq.InvalidInput, String(bad));
    assert.equal(bad.field, "fairness_weight");
    const kind = await client.submit(newId("keyed"), { [sem]: 1 }, { fairnessKey: 7 }).catch((e) => e);
    assert.ok(kind instanceof permitq.InvalidInput && kind.field === "fairnessKey", String(kind));
  });

  it("submits idempotently and refuses other parameters", async () => {
    const id = newId("idem");
    const first = await client.submit(id, { [sem]: 1 }, { ttlSeconds: 30 });
    const again = await client.submit(id, { [sem]: 1 }, { ttlSeconds: 30 });
    assert.equal(first.id, again.id);
    await assert.rejects(client.submit(id, { [sem]: 2 }, { ttlSeconds: 30 }), permitq.ExternalIdTaken);
    await waitFor(async () => (await client.status(id)).state !== "new", "granted");
    assert.equal(await client.release(id), "released");
    assert.equal(await client.status(newId("unknown")), null);
    const none = await client.submit(newId("none"), {}).catch((e) => e);
    assert.ok(none instanceof permitq.InvalidInput && none.field === "permits", String(none));
  });

  it("acquires, heartbeats in the background, exposes the token and releases on dispose", async () => {
    const id = newId("lease");
    const lease = await client.acquire(id, { [sem]: 1 }, { ttlSeconds: 1.5, timeoutMs: 15_000 });
    assert.ok(lease.fencingToken > 0n);
    await sleep(4500); // three ttls: only the heartbeats keep it
    assert.equal(lease.isLost, false, String(lease.signal.reason));
    assert.equal((await client.status(id)).state, "acquired");
    await lease[Symbol.asyncDispose]();
    const done = await client.status(id);
    assert.deepEqual([done.state, done.releaseReason], ["released", "released"]);
  });

  it("releases when the work throws", async () => {
    const id = newId("boom");
    await assert.rejects(
      permitq.withLease(client, id, { [sem]: 1 }, { ttlSeconds: 30 }, async () => {
        throw new Error("work failed");
      }),
      /work failed/,
    );
    assert.equal((await client.status(id)).state, "released");
  });

  it("reports on release to an adaptive semaphore", async () => {
    const adaptive = newId("ts-adaptive");
    await admin.setCapacity(adaptive, 5, { adaptive: { algorithm: "aimd", floor: 1, ceiling: 10 } });
    const pool = new pg.Pool({ connectionString: ADMIN_URL });
    const lease = await client.acquire(newId("adapt"), { [adaptive]: 1 }, { ttlSeconds: 30 });
    await assert.rejects(client.release(lease.externalId, { outcome: "great" }), permitq.InvalidInput);
    assert.equal(await lease.release({ outcome: "overloaded", latencyMs: 50 }), "released");
    await waitFor(
      async () => (await pool.query("SELECT capacity FROM permitq.semaphore WHERE name = $1", [adaptive])).rows[0].capacity === 4,
      "the overload reported lowers the capacity",
      15000,
    );
    await pool.end();
  });

  it("reports while it holds", async () => {
    const adaptive = newId("ts-report");
    await admin.setCapacity(adaptive, 5, { adaptive: { algorithm: "aimd", floor: 1, ceiling: 10 } });
    const pool = new pg.Pool({ connectionString: ADMIN_URL });
    const lease = await client.acquire(newId("hold"), { [adaptive]: 1 }, { ttlSeconds: 30 });
    await assert.rejects(lease.report({ outcome: "great" }), permitq.InvalidInput);
    assert.equal(await lease.report({ outcome: "overloaded", latencyMs: 900 }), true);
    // While it still holds: the report alone lowers the capacity.
    await waitFor(
      async () => (await pool.query("SELECT capacity FROM permitq.semaphore WHERE name = $1", [adaptive])).rows[0].capacity === 4,
      "the overload reported while holding lowers the capacity",
      15000,
    );
    assert.equal((await client.status(lease.externalId)).state, "acquired");
    await lease.release();
    assert.equal(await client.report(lease.externalId, { outcome: "ok" }), false);
    await pool.end();
  });

  it("signals a revoked lease as lost", async () => {
    const id = newId("revoked");
    const lease = await client.acquire(id, { [sem]: 1 }, { ttlSeconds: 1.5 });
    const pool = new pg.Pool({ connectionString: ADMIN_URL });
    await pool.query("SELECT permitq.revoke($1)", [id]);
    await pool.end();
    await waitFor(() => lease.signal.aborted, "lost signalled", 5000);
    assert.match(String(lease.signal.reason), /lease lost/);
    assert.throws(() => lease.check(), permitq.LeaseLost);
    await lease.release();
  });

  it("says lost before the server's lease can run out when the database stops answering", { skip: !SUPER_URL }, async () => {
    const id = newId("stopped");
    const su = new pg.Client({ connectionString: SUPER_URL });
    await su.connect();
    const login = new globalThis.URL(URL).username;
    const lease = await client.acquire(id, { [sem]: 1 }, { ttlSeconds: 3 });
    let pids = [];
    try {
      await waitFor(async () => (await su.query(
        "SELECT heartbeat_at IS NOT NULL AS beat FROM permitq.permit_request WHERE external_id = $1", [id])).rows[0].beat,
        "a first heartbeat");
      // The lease's sessions stop answering, and it cannot open new ones.
      await su.query(`ALTER ROLE "${login}" NOLOGIN`);
      pids = (await su.query("SELECT pid FROM pg_stat_activity WHERE application_name = 'permitq-node-lease'")).rows.map((r) => r.pid);
      assert.ok(pids.length > 0);
      const expires = (await su.query("SELECT expires_at FROM permitq.permit_request WHERE external_id = $1", [id])).rows[0].expires_at;
      for (const pid of pids) process.kill(pid, "SIGSTOP");
      await waitFor(() => lease.signal.aborted, "lost signalled", 5000);
      assert.match(String(lease.signal.reason), /no heartbeat was confirmed in time/);
      const before = (await su.query("SELECT now() < $1 AS before", [expires])).rows[0].before;
      assert.equal(before, true, "signalled before expires_at");
    } finally {
      for (const pid of pids) process.kill(pid, "SIGCONT");
      await su.query(`ALTER ROLE "${login}" LOGIN`);
      await su.end();
      await lease.release();
    }
  });

  it("hands out increasing tokens, and waits by polling alone too", async () => {
    const polling = new permitq.Client({ connectionString: URL, listen: false });
    const tokens = [];
    for (let i = 0; i < 3; i++) {
      await permitq.withLease(polling, newId("tok"), { [sem]: 1 }, { ttlSeconds: 30 }, async (lease) => {
        tokens.push(lease.fencingToken);
      });
    }
    await polling.end();
    assert.ok(tokens[0] < tokens[1] && tokens[1] < tokens[2], String(tokens));
  });

  it("throws typed errors with their detail", async () => {
    const huge = await client.acquire(newId("huge"), { [sem]: 5 }).catch((e) => e);
    assert.ok(huge instanceof permitq.ExceedsCapacity, String(huge));
    assert.equal(huge.errorDetail.capacity, 2);
    assert.ok(
      huge.message.includes(
        `${sem}=5 but ${sem} has capacity 2: it can never be granted; ask for at most 2, or raise ` +
          `the capacity (\`permitq semaphore set ${sem} 5\`)`,
      ),
      huge.message,
    );
    const typo = await client.acquire(newId("typo"), { [`${sem}x`]: 1 }).catch((e) => e);
    assert.ok(typo instanceof permitq.UnknownSemaphore, String(typo));
    assert.ok(typo.errorDetail.similar.includes(sem));
    // A template at its bound: the idle instance to delete is named.
    const lab = newId("lab");
    await admin.setCapacity(`${lab}-*`, 1, { maxInstances: 1 });
    await permitq.withLease(client, newId("inst"), { [`${lab}-1`]: 1 }, {}, async () => {});
    const over = await client.acquire(newId("inst"), { [`${lab}-2`]: 1 }).catch((e) => e);
    assert.ok(over instanceof permitq.TooManyInstances, String(over));
    assert.ok(
      over.message.includes(`${lab}-1 holds nothing: delete one (\`permitq semaphore delete ${lab}-1\`)`),
      over.message,
    );
    // A template bounded to none makes none: nothing to delete.
    await admin.setCapacity(`${lab}-none-*`, 1, { maxInstances: 0 });
    const none = await client.acquire(newId("inst"), { [`${lab}-none-1`]: 1 }).catch((e) => e);
    assert.ok(none instanceof permitq.TooManyInstances, String(none));
    assert.ok(
      none.message.includes(`template ${lab}-none-* has max_instances 0: it makes no instance at all`) &&
        !none.message.includes("delete"),
      none.message,
    );
    // Refused by the server, naming its field.
    const bad = await client.submit(newId("bad"), { [sem]: 1 }, { ttlSeconds: 0 }).catch((e) => e);
    assert.ok(bad instanceof permitq.InvalidInput, String(bad));
    assert.equal(bad.field, "ttl");
    await assert.rejects(client.heartbeat(newId("never")), permitq.LeaseLost);
  });

  it("refuses options it does not know or of the wrong kind before sending anything", async () => {
    const cases = [
      [{ ttlSeconds: "30s" }, "ttlSeconds", /must be a non-negative number \(seconds, e\.g\. 30\), got "30s"/],
      [{ ttlSeconds: -1 }, "ttlSeconds", /must be a non-negative number/],
      [{ ttl: 30 }, "ttl", /invalid option ttl: did you mean ttlSeconds\?/],
      [{ timeout: 5000 }, "timeout", /did you mean timeoutMs\?/],
      [{ priority: 1.5 }, "priority", /must be a whole number/],
      [{ owner: 7 }, "owner", /must be a string/],
    ];
    for (const [options, field, said] of cases) {
      const id = newId("opt");
      const e = await client.acquire(id, { [sem]: 1 }, options).catch((err) => err);
      assert.ok(e instanceof permitq.InvalidInput, `${JSON.stringify(options)}: ${e}`);
      assert.equal(e.field, field);
      assert.match(e.message, said);
      assert.equal(await client.status(id), null, "nothing was submitted");
    }
    // submit takes no acquire options: a deadline there would be ignored.
    const e = await client.submit(newId("opt"), { [sem]: 1 }, { timeoutMs: 5 }).catch((err) => err);
    assert.ok(e instanceof permitq.InvalidInput && e.field === "timeoutMs", String(e));
    // The id left out (plain JavaScript): said so, not "no semaphore named timeoutMs".
    const noId = await permitq
      .withLease(client, { [sem]: 1 }, { ttlSeconds: 30, timeoutMs: 3000 }, async () => {})
      .catch((err) => err);
    assert.ok(noId instanceof permitq.InvalidInput && noId.field === "externalId", String(noId));
    assert.match(noId.message, /the request's id, chosen by you, comes first, before the permits/);
  });

  it("says a heartbeat on an id no request has is an unknown request", async () => {
    const never = newId("never");
    const e = await client.heartbeat(never).catch((err) => err);
    assert.ok(e instanceof permitq.UnknownRequest && e instanceof permitq.LeaseLost, String(e));
    assert.ok(e.message.includes(`no request named ${never}: none was submitted under that external_id (check it)`), e.message);
  });

  it("says a heartbeat on a waiting request has no lease yet", async () => {
    const holders = [
      await client.acquire(newId("hold"), { [sem]: 1 }, { ttlSeconds: 30 }),
      await client.acquire(newId("hold"), { [sem]: 1 }, { ttlSeconds: 30 }),
    ];
    try {
      const waiting = newId("waiting");
      await client.submit(waiting, { [sem]: 1 });
      const e = await client.heartbeat(waiting).catch((err) => err);
      assert.ok(e instanceof permitq.NoLeaseYet && e instanceof permitq.LeaseLost, String(e));
      assert.match(e.message, /still waiting to be granted/);
      // The server's hint comes with it, as in Python.
      assert.match(e.message, /heartbeat once it is acquired/i);
      await client.release(waiting);
    } finally {
      for (const h of holders) await h.release();
    }
  });

  it("refuses a malformed URL at once and a refused login without retrying", async () => {
    const form = /expected postgres:\/\/user\[:password\]@host\[:port\]\/database/;
    for (const [url, said] of [
      ["localhost/app", /"localhost\/app" has no scheme/],
      ["mysql://a@h/db", /mysql:\/\/ is not PostgreSQL's scheme/],
      ["postgres://me:p@ss@localhost/app", /must be percent-encoded in the URL \(@ as %40/],
      ["postgres://a@h/db?sslmode=bogus", /sslmode "bogus" is not one of/],
      ["", /it is empty, and no PGHOST, PGUSER or PGDATABASE is set \(is DATABASE_URL set but empty\?\)/],
    ]) {
      // (and a Unix socket in the query is accepted: see below)
      let e;
      try {
        new permitq.Client({ connectionString: url });
      } catch (err) {
        e = err;
      }
      assert.ok(e instanceof permitq.InvalidInput && e.field === "database URL", `${url}: ${e}`);
      assert.match(e.message, said);
      assert.match(e.message, form);
    }
    new permitq.Client({ connectionString: "postgres://me:secret@/app?host=/var/run/postgresql" });
    const target = new globalThis.URL(URL);
    target.username = "no_such_login_here";
    target.password = "";
    const stranger = new permitq.Client({ connectionString: target.toString() });
    const started = Date.now();
    const e = await stranger.acquire(newId("stranger"), { [sem]: 1 }, { timeoutMs: 5000 }).catch((err) => err);
    assert.ok(e instanceof permitq.LoginRejected, String(e));
    assert.ok(Date.now() - started < 4000, "not retried until the deadline: retrying cannot help");
    await stranger.end();
    // A database that does not exist: create it or name another (not pg_hba.conf).
    const elsewhere = new globalThis.URL(URL);
    elsewhere.pathname = "/no_such_database_here";
    const nowhere = new permitq.Client({ connectionString: elsewhere.toString() });
    const missing = await nowhere.acquire(newId("nowhere"), { [sem]: 1 }, { timeoutMs: 5000 }).catch((err) => err);
    assert.ok(missing instanceof permitq.LoginRejected, String(missing));
    assert.match(missing.message, /create it \(createdb/);
    assert.doesNotMatch(missing.message, /pg_hba/);
    await nowhere.end();
  });

  it("names who revoked a request while it waited", () => {
    const e = permitq.requestFailed("r-1", "cancelled", { revoked_by: "ops" });
    assert.match(e.message, /revoked by ops \(`permitq revoke`\) while it was still waiting/);
  });

  it("says a timeout or cancel that took its key's turn keeps the turn taken", () => {
    const said = "; its turn on gpu stays taken for its fairness key until the line passes it, so the key's next request there is placed behind it";
    const timedOut = permitq.requestFailed("r-1", "timeout", { semaphore: "gpu", count: 1, capacity: 1, free: 0, turn_kept_on: ["gpu"] });
    assert.ok(timedOut.message.includes(said), timedOut.message);
    const revoked = permitq.requestFailed("r-2", "cancelled", { revoked_by: "ops", turn_kept_on: ["gpu"] });
    assert.ok(revoked.message.includes("if it is still wanted" + said), revoked.message);
    const plain = permitq.requestFailed("r-3", "timeout", { semaphore: "gpu", count: 1, capacity: 1, free: 0 });
    assert.doesNotMatch(plain.message, /turn/);
  });

  it("tells a template named itself to name an instance", () => {
    const e = permitq.requestFailed("r-5", "unknown_semaphore", { semaphore: "lab:*", similar: [] });
    assert.ok(e.message.includes("lab:* is a template, which is never granted itself: name an instance of it (lab:NAME"), e.message);
    assert.ok(!e.message.includes("create it"), e.message);
  });

  it("says an unknown semaphore as the CLI says it", () => {
    const typo = permitq.requestFailed("r-6", "unknown_semaphore", { semaphore: "GPU", similar: ["gpu"] });
    assert.ok(typo.message.includes("no semaphore named GPU, and no template matches it; did you mean gpu?"), typo.message);
    const none = permitq.requestFailed("r-7", "unknown_semaphore", { semaphore: "zzz", similar: [] });
    assert.ok(
      none.message.includes(
        "no semaphore named zzz, and no template matches it; create it with " +
          "`permitq semaphore set zzz CAPACITY` (or a template NAME* that matches it)",
      ),
      none.message,
    );
    const parent = permitq.requestFailed("r-8", "unknown_semaphore", { semaphore: "pool", named: "gpu-a", similar: [] });
    assert.ok(parent.message.includes("gpu-a's parent pool does not exist"), parent.message);
  });

  it("says where exceeds_capacity was hit and the command that fixes it", () => {
    const parent = permitq.requestFailed("r-2", "exceeds_capacity", { semaphore: "gpus", named: "gpu-a", count: 5, capacity: 4 });
    assert.ok(
      parent.message.includes(
        "gpu-a takes 5 from its parent gpus, which has capacity 4: it can never be granted; " +
          "ask for at most 4, or raise the capacity (`permitq semaphore set gpus 5`)",
      ),
      parent.message,
    );
    const window = permitq.requestFailed("r-3", "exceeds_capacity", { semaphore: "api", count: 9, capacity: 0, per: "1s" });
    assert.ok(window.message.includes("api=9 but api allows 0 grants per 1s: it can never be granted; raise the capacity"), window.message);
    const instance = permitq.requestFailed("r-4", "exceeds_capacity", { semaphore: "lab:a", template: "lab:*", count: 3, capacity: 2 });
    assert.ok(instance.message.includes("(`permitq semaphore set 'lab:*' 3`); then submit again"), instance.message);
    const adaptive = { algorithm: "aimd", floor: 2, ceiling: 10 };
    const backedOff = permitq.requestFailed("r-5", "exceeds_capacity", { semaphore: "calls", count: 8, capacity: 7, adaptive: { ...adaptive, from: 8 } });
    assert.ok(
      backedOff.message.includes(
        "calls=8 but calls has capacity 7 now: the workers backed it off from 8 (adaptive, aimd from 2 to 10) on its " +
          "holders' reports, and it may grow back; a request is decided against the capacity it finds, so ask for at " +
          "most 2 (its floor, which always fits)",
      ),
      backedOff.message,
    );
    const atCeiling = permitq.requestFailed("r-8", "exceeds_capacity", { semaphore: "calls", count: 10, capacity: 7, adaptive });
    assert.ok(
      atCeiling.message.includes("--floor 10 --ceiling 10`: with floor and ceiling equal it stays at 10, no longer adapting)"),
      atCeiling.message,
    );
    const above = permitq.requestFailed("r-6", "exceeds_capacity", { semaphore: "calls", count: 12, capacity: 7, adaptive });
    assert.ok(
      above.message.includes(
        "calls=12 but calls is adaptive, aimd from 2 to 10 (its capacity is 7 now): it can never be granted; ask for " +
          "at most 10, or raise its ceiling (`permitq semaphore set calls 7 --adaptive aimd --floor 2 --ceiling 12`)",
      ),
      above.message,
    );
    const below = permitq.requestFailed("r-7", "exceeds_capacity", { semaphore: "calls", count: 2, capacity: 1, adaptive });
    assert.ok(
      below.message.includes(
        "calls=2 but calls has capacity 1 now, below its floor 2 (adaptive, aimd from 2 to 10): it was set by hand, " +
          "and the workers bring it back within its bounds at their next cadence",
      ),
      below.message,
    );
  });

  it("cancels at the deadline or on abort, so nothing waits on", async () => {
    const holders = [
      await client.acquire(newId("full"), { [sem]: 1 }, { ttlSeconds: 30 }),
      await client.acquire(newId("full"), { [sem]: 1 }, { ttlSeconds: 30 }),
    ];
    try {
      const late = newId("late");
      const started = Date.now();
      const e = await client.acquire(late, { [sem]: 1 }, { timeoutMs: 1000 }).catch((err) => err);
      assert.ok(e instanceof permitq.AcquireTimeout, String(e));
      assert.ok(Date.now() - started < 5000);
      const s = await client.status(late);
      assert.deepEqual([s.state, s.errorCode], ["error", "cancelled"]);
      assert.match(e.message, new RegExp(`\\(${sem}: `), "what held it back");
      for (const lease of holders) assert.ok(e.message.includes(`${lease.externalId} (1 for `), e.message);
      assert.ok(e.message.includes(", held by "), "whom it waited on");
      assert.match(e.message, /; it was cancelled, so it no longer waits: acquire again/);
      assert.doesNotMatch(e.message, /nothing is granting/, "workers run");
      const again = await client.acquire(late, { [sem]: 1 }, { timeoutMs: 1000 }).catch((err) => err);
      assert.match(String(again), /was submitted before and has ended/);
      const aborted = newId("aborted");
      const e2 = await client.acquire(aborted, { [sem]: 1 }, { signal: AbortSignal.timeout(300) }).catch((err) => err);
      assert.ok(e2 instanceof permitq.AcquireTimeout, String(e2));
      assert.equal((await client.status(aborted)).errorCode, "cancelled");
      assert.match((await client.explain(late)).outcome, /cancelled/);
    } finally {
      for (const lease of holders) await lease.release();
    }
  });

  it("wakes a waiting acquire when room comes free", async () => {
    const holders = [
      await client.acquire(newId("hold"), { [sem]: 1 }, { ttlSeconds: 30 }),
      await client.acquire(newId("hold"), { [sem]: 1 }, { ttlSeconds: 30 }),
    ];
    const id = newId("next");
    // Reading the status only every 60 s: only the event can wake it in time.
    const eventsOnly = new permitq.Client({ connectionString: URL, pollMs: 60_000 });
    const waiting = eventsOnly.acquire(id, { [sem]: 1 }, { timeoutMs: 30_000 });
    await waitFor(async () => (await client.explain(id))?.semaphores[0]?.position, "examined");
    assert.equal((await client.explain(id)).semaphores[0].shortfall, 1);
    const released = Date.now();
    await holders[0].release();
    const lease = await waiting;
    assert.ok(Date.now() - released < 10_000, "woken by the event, not by a status read");
    assert.equal(lease.status.state, "acquired");
    await lease.release();
    await holders[1].release();
    await eventsOnly.end();
  });

  it("leaves no abort listener behind and heartbeats an earlier grant before handing it over", async () => {
    const controller = new AbortController();
    const id = newId("again");
    const first = await client.acquire(id, { [sem]: 1 }, { ttlSeconds: 30, signal: controller.signal });
    try {
      assert.equal(getEventListeners(controller.signal, "abort").length, 0);
      const grantedUntil = (await client.status(id)).expiresAt;
      // A retry of the same acquire: the same grant, whose lease clock must not start now.
      const again = await client.acquire(id, { [sem]: 1 }, { ttlSeconds: 30, signal: controller.signal });
      assert.equal(again.fencingToken, first.fencingToken);
      assert.equal(again.isLost, false);
      assert.ok((await client.status(id)).expiresAt > grantedUntil, "a heartbeat extended it");
      assert.equal(getEventListeners(controller.signal, "abort").length, 0);
    } finally {
      await first.release();
    }
  });

  it("stops retrying an unreachable database when its signal aborts", async () => {
    const down = new permitq.Client({ connectionString: "postgres://nobody@127.0.0.1:1/nothing" });
    const started = Date.now();
    const e = await down
      .acquire(newId("down"), { x: 1 }, { timeoutMs: 8000, signal: AbortSignal.timeout(200) })
      .catch((err) => err);
    assert.ok(e instanceof permitq.DatabaseUnavailable, String(e));
    assert.ok(Date.now() - started < 4000, `gave up when the signal aborted, after ${Date.now() - started} ms`);
    await down.end();
  });

  it("names the database a missing schema was looked for in", { skip: !SUPER_URL }, async () => {
    const db = newId("noschema").replaceAll("-", "_");
    const su = new pg.Client({ connectionString: SUPER_URL });
    await su.connect();
    await su.query(`CREATE DATABASE ${db}`);
    const url = new globalThis.URL(SUPER_URL);
    url.pathname = `/${db}`;
    const elsewhere = new permitq.Client({ connectionString: url.toString() });
    try {
      const e = await elsewhere.status("x").catch((err) => err);
      assert.ok(e instanceof permitq.PermitqError, String(e));
      assert.ok(e.message.includes(`older than this client in database ${db} at ${url.hostname}:${url.port} as `), e.message);
      assert.ok(e.message.includes("run `permitq migrate` there; or, if permitq was migrated into another database, fix the URL"), e.message);
    } finally {
      await elsewhere.end();
      await su.query(`DROP DATABASE ${db}`);
      await su.end();
    }
  });

  it("hands over a lease granted after a wait longer than its ttl not lost", async () => {
    const holders = [];
    for (let i = 0; i < 2; i++) holders.push(await client.acquire(newId("hold"), { [sem]: 1 }, { ttlSeconds: 30 }));
    const waiter = new permitq.Client({ connectionString: URL });
    try {
      const acquiring = waiter.acquire(newId("longwait"), { [sem]: 1 }, { ttlSeconds: 3, timeoutMs: 20_000 });
      // Longer than the lease's 3 s ttl: its clock, started at the submit, would have run out.
      await sleep(4000);
      await holders[0].release();
      const lease = await acquiring;
      assert.ok(!lease.isLost, String(lease.signal.reason));
      lease.check();
      await lease.release();
    } finally {
      for (const h of holders) await h.release();
      await waiter.end();
    }
  });

  it("says lost once its request is released through the client", async () => {
    const id = newId("given-back");
    const lease = await client.acquire(id, { [sem]: 1 }, { ttlSeconds: 30, timeoutMs: 15_000 });
    assert.equal(await client.release(id), "released");
    assert.ok(lease.isLost);
    assert.throws(() => lease.check(), (e) => e instanceof permitq.LeaseLost &&
      e.message.includes(`released through client.release("${id}") (released): the permits are given back`));
    assert.equal(await lease.release(), "released", "the outcome, not a second release");
  });

  it("names the role a login without one needs", { skip: !SUPER_URL }, async () => {
    const login = newId("norole").replaceAll("-", "_");
    const su = new pg.Client({ connectionString: SUPER_URL });
    await su.connect();
    await su.query(`CREATE ROLE ${login} LOGIN PASSWORD 'pw'`);
    const url = new globalThis.URL(SUPER_URL);
    url.username = login;
    url.password = "pw";
    const plain = new permitq.Client({ connectionString: url.toString() });
    try {
      const e = await plain.submit(newId("p"), { [sem]: 1 }).catch((err) => err);
      assert.ok(e instanceof permitq.RoleMissing && e instanceof permitq.NotOwner, String(e));
      assert.match(e.message, /permission denied for schema permitq; this needs the role permitq_producer: use a login that has it, or a DBA runs GRANT permitq_producer TO <your login>/);
    } finally {
      await plain.end();
      await su.query(`DROP ROLE ${login}`);
      await su.end();
    }
  });

  it("says once that it retries, and at the deadline that the request may still wait", async () => {
    const holders = [];
    for (let i = 0; i < 2; i++) holders.push(await client.acquire(newId("hold"), { [sem]: 1 }, { ttlSeconds: 30 }));
    const id = newId("left");
    const waiter = new permitq.Client({ connectionString: URL });
    // The outage as the client meets it (its reads and its cancel fail), after a real submit.
    const down = () => Promise.reject(new permitq.DatabaseUnavailable("connection refused (simulated)"));
    waiter.statusAndBarrier = down;
    waiter.release = down;
    const warnings = [];
    const onWarning = (w) => warnings.push(w);
    process.on("warning", onWarning);
    try {
      const e = await waiter.acquire(id, { [sem]: 1 }, { timeoutMs: 1000 }).catch((err) => err);
      assert.ok(e instanceof permitq.DatabaseUnavailable, String(e));
      assert.ok(e.message.includes(
        `request ${id} was submitted and could not be cancelled, so it may still be waiting: ` +
          `once the database answers, cancel it (client.release("${id}") or \`permitq release ${id}\`)`), e.message);
      await new Promise((resolve) => setImmediate(resolve));
      assert.ok(warnings.some((w) => w.code === "PERMITQ_RETRYING"), "said once that it retries");
      assert.equal((await client.status(id)).state, "new", "what the error said");
    } finally {
      process.off("warning", onWarning);
      await client.release(id);
      for (const lease of holders) await lease.release();
      await waiter.end();
    }
  });

  it("keeps another producer's request from it", { skip: !OTHER_URL }, async () => {
    const id = newId("mine");
    const lease = await client.acquire(id, { [sem]: 1 }, { ttlSeconds: 30 });
    const other = new permitq.Client({ connectionString: OTHER_URL });
    try {
      assert.equal(await other.status(id), null);
      await assert.rejects(other.release(id), permitq.NotOwner);
    } finally {
      await other.end();
      await lease.release();
    }
  });

  it("sends only statements the schema has: each one prepares", async () => {
    const names = Object.keys(permitq.SQL);
    assert.ok(names.length >= 8, String(names));
    const conn = new pg.Client({ connectionString: ADMIN_URL });
    await conn.connect();
    try {
      for (const name of names) {
        await conn.query(`PREPARE contract_${name} AS ${permitq.SQL[name]}`);
        await conn.query(`DEALLOCATE contract_${name}`);
      }
    } finally {
      await conn.end();
    }
  });

  it("says an unreachable database is retryable", async () => {
    const down = new permitq.Client({ connectionString: "postgres://nobody@127.0.0.1:1/nothing" });
    await assert.rejects(down.status("x"), permitq.DatabaseUnavailable);
    // acquire retries (its LISTEN connection, its idempotent submit) until its deadline.
    const started = Date.now();
    // It says so when it starts retrying: a database that is down must not read as a busy semaphore.
    const warnings = [];
    const onWarning = (w) => warnings.push(w);
    process.on("warning", onWarning);
    const e = await down.acquire(newId("down"), { x: 1 }, { timeoutMs: 1500 }).catch((err) => err);
    assert.ok(e instanceof permitq.DatabaseUnavailable, String(e));
    // Never reached, nothing was submitted: it does not say a request may be waiting.
    assert.ok(!e.message.includes("was submitted"), e.message);
    assert.ok(Date.now() - started > 500, "it retried, not gave up at once");
    await new Promise((resolve) => setImmediate(resolve));
    process.off("warning", onWarning);
    assert.ok(
      warnings.some((w) => w.code === "PERMITQ_RETRYING" && /retrying until the acquire's deadline/.test(w.message)),
      String(warnings),
    );
    await down.end();
  });
});
