/**
 * permitq for TypeScript producers: submit permit requests, acquire with a heartbeating lease
 * and its fencing token, release; errors as types. A thin layer over permitq's SQL API
 * (node-postgres).
 *
 * ```ts
 * const client = new Client({ connectionString: process.env.DATABASE_URL });
 * await using lease = await client.acquire("train-7", { gpu: 2 }, { ttlSeconds: 30, timeoutMs: 600_000 });
 * lease.check();                      // throws LeaseLost before the lease can run out
 * await write(lease.fencingToken);
 * ```
 */
import { existsSync } from "node:fs";
import { userInfo } from "node:os";
import pg from "pg";
import { AcquireTimeout, ExternalIdTaken, InvalidInput, LeaseLost, PermitqError, DatabaseUnavailable, RequestFailed, requestFailed, translated, } from "./errors.js";
import { ACQUIRE_OPTIONS, SUBMIT_OPTIONS, checkConfig, checkExternalId, checkOptions, checkUrl } from "./checks.js";
import { SQL } from "./sql.js";
export * from "./errors.js";
export { SQL } from "./sql.js";
/** The channel the workers announce outcomes on (payloads: JSON arrays of request ids). */
const EVENTS = "permitq_events";
/** How often a waiting acquire reads the status again without a notification. */
const POLL_MS = 250;
/** How long before the lease could have run out on the server a Lease says it is lost. */
const SAFETY_FRACTION = 0.2;
/** The start of `explain`'s reason for a request no worker has examined yet: it speaks of a
 * running worker, which "nothing is granting" contradicts. */
const NOT_EXAMINED = "not examined by a worker yet: a running worker does";
function checkedOutcome(outcome) {
    if (!["ok", "overloaded", "failed"].includes(outcome)) {
        throw new InvalidInput(`outcome: must be ok, overloaded (a 429, a timeout, a pool exhausted) or failed, got ${JSON.stringify(outcome)}`, "outcome");
    }
    return outcome;
}
/** The arguments of a report: while holding (`report`), or with the release (`releaseReporting`). */
function reportArgs(externalId, report) {
    return [externalId, checkedOutcome(report.outcome), reportLatency(report.latencyMs)];
}
function reportLatency(latencyMs) {
    if (latencyMs === undefined)
        return null;
    if (!Number.isFinite(latencyMs) || latencyMs < 0) {
        throw new InvalidInput(`latencyMs: must be a number of milliseconds, 0 or more, got ${String(latencyMs)}`, "latencyMs");
    }
    return latencyMs / 1000;
}
function status(row) {
    const optionalBig = (v) => (v == null ? null : BigInt(v));
    return {
        id: BigInt(row.id),
        externalId: row.external_id,
        permits: row.permits,
        owner: row.owner ?? null,
        state: row.state,
        errorCode: row.error_code ?? null,
        errorDetail: row.error_detail ?? null,
        releaseReason: row.release_reason ?? null,
        fencingToken: optionalBig(row.fencing_token),
        acquiredAt: row.acquired_at ?? null,
        expiresAt: row.expires_at ?? null,
        releasedAt: row.released_at ?? null,
        ttlSeconds: row.ttl ?? null,
        waitSeconds: row.wait ?? null,
        priority: row.priority,
        fairnessKey: row.fairness_key ?? null,
        fairnessWeight: row.fairness_weight ?? null,
    };
}
/** Resolves after `ms`, or at once when `signal` aborts (its listener removed either way). */
const sleep = (ms, signal) => new Promise((resolve) => {
    const done = () => {
        clearTimeout(timer);
        signal?.removeEventListener("abort", done);
        resolve();
    };
    const timer = setTimeout(done, ms);
    signal?.addEventListener("abort", done, { once: true });
});
/**
 * As libpq does for a URL without a host (`postgres:///app`): the local server's socket
 * (Debian's directory, then /tmp), where node-postgres would try localhost over TCP; and the OS
 * user for a URL without one. (Written into the URL: node-postgres lets the URL's values win.)
 */
function localSocket(config) {
    if (config.host || !config.connectionString)
        return {};
    let url;
    try {
        url = new URL(config.connectionString);
    }
    catch {
        return {};
    }
    // (A URL without a host cannot carry a user name: it goes in the query, which pg reads too.)
    if (url.username === "" && !config.user && !url.searchParams.has("user")) {
        url.searchParams.set("user", userInfo().username);
    }
    if (url.hostname === "" && !url.searchParams.has("host") && !process.env.PGHOST) {
        const port = url.port || url.searchParams.get("port") || process.env.PGPORT || "5432";
        const dir = ["/var/run/postgresql", "/tmp"].find((d) => existsSync(`${d}/.s.PGSQL.${port}`));
        if (dir)
            url.searchParams.set("host", dir);
    }
    return { connectionString: url.toString() };
}
/** A producer's handle on permitq: a small pool, and a connection of its own per waiting acquire. */
/**
 * A node-postgres client whose failed connection attempt closes its socket: node-postgres leaves
 * it open (after a password the server asked for and none was given, say), and the server's
 * `authentication_timeout` then keeps the process alive for up to a minute after `end()`.
 */
const ClosingClient = class extends pg.Client {
    // @ts-expect-error one signature for node-postgres's overloads (a callback, or a promise)
    connect(callback) {
        const close = (err) => {
            this.connection?.stream?.destroy();
            return err;
        };
        if (callback) {
            return super.connect((err) => (err ? callback(close(err)) : callback(null, this)));
        }
        return super.connect().catch((err) => { throw close(err); });
    }
};
/**
 * The leases each client handed out and not released: a `client.release(id)` of one of them tells
 * it, so that it says lost rather than go on as if it held the permits.
 */
const leasesOf = new WeakMap();
/** How a client tells a lease it was released through `client.release(id)`. */
const GIVEN_BACK = Symbol("givenBack");
export class Client {
    pool;
    listen;
    /** How often a waiting acquire reads its status without a notification. */
    pollMs;
    /** How to connect: the caller's config, the local socket filled in, `listen` taken out. */
    connect;
    /**
     * `config` as node-postgres takes it; `listen: false` waits by reading the status only (through
     * a pooler in transaction mode, where LISTEN does not work; no statement is prepared either);
     * `pollMs` (250): how often a waiting acquire reads its status besides the events.
     */
    constructor(config) {
        const { listen, pollMs, ...poolConfig } = config;
        checkConfig(poolConfig);
        if (poolConfig.connectionString !== undefined)
            checkUrl(poolConfig.connectionString);
        checkOptions({ pollMs }, ["pollMs"]);
        this.listen = listen ?? true;
        this.pollMs = pollMs ?? POLL_MS;
        this.connect = { ...poolConfig, ...localSocket(poolConfig) };
        this.pool = new pg.Pool({ max: 4, application_name: "permitq-node", keepAlive: true, ...this.connect, Client: ClosingClient });
        this.pool.on("error", () => { }); // an idle connection that broke: the next query reconnects
    }
    /** A connection of its own (a LISTEN, a lease's heartbeats), not from the pool. */
    connection(applicationName) {
        const client = new ClosingClient({ ...this.connect, application_name: applicationName, keepAlive: true });
        client.on("error", () => { }); // a broken one is replaced by its user
        return client;
    }
    /** Closes the pool and the idle LISTEN connections. */
    async end() {
        const idle = this.listeners.splice(0);
        await Promise.all(idle.map((l) => l.end().catch(() => { })));
        await this.pool.end();
    }
    /** LISTEN connections between acquires (one per acquire waiting at once): opening one for
     * every acquire cost more than the wait. One idle for 10 s is closed. */
    listeners = [];
    brokenListeners = new WeakSet();
    /** A connection that LISTENs on the events: an idle one, else a new one. */
    async takeListener() {
        for (let idle = this.listeners.pop(); idle; idle = this.listeners.pop()) {
            if (!this.brokenListeners.has(idle))
                return idle;
            idle.end().catch(() => { });
        }
        const listener = this.connection("permitq-node-listen");
        listener.on("error", () => this.brokenListeners.add(listener));
        listener.on("end", () => this.brokenListeners.add(listener));
        try {
            await listener.connect();
            await listener.query(`LISTEN ${EVENTS}`);
        }
        catch (e) {
            listener.end().catch(() => { });
            throw translated(e);
        }
        return listener;
    }
    /** Keeps a sound listener for the next acquire (events that reach it meanwhile only make that
     * acquire read its status once more), and closes it if no acquire takes it within 10 s. */
    giveBackListener(listener) {
        if (this.brokenListeners.has(listener)) {
            listener.end().catch(() => { });
            return;
        }
        this.listeners.push(listener);
        setTimeout(() => {
            const at = this.listeners.indexOf(listener);
            if (at >= 0) {
                this.listeners.splice(at, 1);
                listener.end().catch(() => { });
            }
        }, 10_000).unref();
    }
    async query(sql, args) {
        try {
            return (await this.pool.query(sql, args)).rows;
        }
        catch (e) {
            throw translated(e, this.database());
        }
    }
    /** Where this client works, as messages name it: `database app at localhost:5432 as app`. */
    database() {
        const o = this.pool.options;
        try {
            const url = o.connectionString ? new URL(o.connectionString) : null;
            const user = decodeURIComponent(url?.username || "") || o.user || process.env.PGUSER || "(the OS user)";
            const db = decodeURIComponent(url?.pathname.slice(1) || "") || o.database || process.env.PGDATABASE || user;
            const host = url?.hostname || o.host || process.env.PGHOST || "localhost";
            const port = url?.port || o.port || process.env.PGPORT || 5432;
            return `database ${db} at ${host}:${port} as ${user}`;
        }
        catch {
            return undefined;
        }
    }
    /** Submits a request, idempotent by `externalId` (other parameters throw ExternalIdTaken). */
    async submit(externalId, permits, options = {}) {
        checkExternalId(externalId);
        checkOptions(options, SUBMIT_OPTIONS);
        if (Object.keys(permits).length === 0) {
            throw new InvalidInput("permits: name at least one semaphore and its count, e.g. { gpu: 1 }", "permits");
        }
        const rows = await this.query(SQL.submit, [externalId, JSON.stringify(permits), options.owner ?? null, options.ttlSeconds ?? null,
            options.waitSeconds ?? null, options.priority ?? 0, options.fairnessKey ?? null,
            options.fairnessWeight ?? null]);
        return status(rows[0]);
    }
    /** The request, or null for an unknown id (or another login's, for a producer). */
    async status(externalId) {
        const rows = await this.query(SQL.status, [externalId]);
        return rows.length ? status(rows[0]) : null;
    }
    /** `status`, and whether an outcome read needs `confirmDurable` here. */
    async statusAndBarrier(externalId) {
        const rows = await this.query(SQL.statusAndBarrier, [externalId]);
        return rows.length ? [status(rows[0]), rows[0].barrier === true] : null;
    }
    /**
     * Gives the permits back: `released`, `already_released`, `cancelled`, `not_acquired`, `unknown`.
     * With `report.outcome` (`ok`, `overloaded`, `failed`) and an optional `latencyMs`, reports how the
     * use went to the adaptive semaphores it held.
     */
    async release(externalId, report) {
        const rows = report
            ? await this.query(SQL.releaseReporting, reportArgs(externalId, report))
            : await this.query(SQL.release, [externalId]);
        const outcome = rows[0].outcome;
        const lease = leasesOf.get(this)?.get(externalId)?.deref();
        leasesOf.get(this)?.delete(externalId);
        lease?.[GIVEN_BACK](outcome);
        return outcome;
    }
    /** Extends the lease (to now + `extendSeconds`, else its ttl); throws LeaseLost when it is gone. */
    async heartbeat(externalId, extendSeconds) {
        const rows = await this.query(SQL.heartbeat, [externalId, extendSeconds ?? null]);
        return rows[0].until ?? null;
    }
    /**
     * Reports how the holder's use went so far, while it still holds, to the adaptive semaphores it
     * holds. Whether it was kept: `false` when no request has the id, when it is not held, or when
     * none of its semaphores is adaptive. Until a cadence applies it, a later report replaces it
     * unless it says less (ok < failed < overloaded).
     */
    async report(externalId, report) {
        const rows = await this.query(SQL.report, reportArgs(externalId, report));
        return rows[0].kept;
    }
    /** Why the request waits, per semaphore; or how it ended. Null for an unknown id. */
    async explain(externalId) {
        const rows = await this.query(SQL.explain, [externalId]);
        if (rows.length === 0)
            return null;
        const first = rows[0];
        return {
            externalId: first.request,
            state: first.state,
            outcome: first.outcome ?? null,
            semaphores: rows.filter((r) => r.semaphore != null).map((r) => ({
                semaphore: r.semaphore,
                needs: r.needs,
                capacity: r.capacity,
                free: r.free,
                shortfall: r.shortfall,
                position: r.position,
                permitsAhead: r.permits_ahead,
                reason: r.reason,
                holders: (r.holders ?? []).map((h) => ({
                    externalId: h.external_id,
                    count: h.count,
                    heldForSeconds: h.held_for_s,
                    expiresInSeconds: h.expires_in_s ?? null,
                })),
                estimatedWaitSeconds: r.estimated,
                fairness: r.fairness ?? null,
            })),
        };
    }
    /** Creates or changes a semaphore (admins); an option left out keeps its setting. */
    /**
     * Creates or changes a semaphore (admins); a setting left out is kept. `adaptive`: an algorithm
     * (`aimd` or `gradient`) with a floor and a ceiling lets the workers set the capacity from the
     * holders' reports (`lease.release({ outcome })`); `false` fixes it again.
     */
    async setCapacity(name, capacity, options = {}) {
        const args = [name, capacity, options.fair ?? null, options.perSeconds ?? null,
            options.maxInstances ?? null, options.parent ?? null, options.guarantee ?? null];
        const rows = options.adaptive === undefined
            ? await this.query(SQL.setCapacity, args)
            : await this.query(SQL.setCapacityAdaptive, [...args, JSON.stringify(options.adaptive)]);
        return rows[0];
    }
    /** `; nothing is granting: ...` when no worker runs, else empty. */
    async nothingGranting() {
        const rows = await this.query(SQL.granting, []);
        const row = rows[0];
        if (!row || row.live_workers > 0)
            return "";
        const since = row.seen_ago == null ? "in the last hour" : `for ${Math.round(row.seen_ago)}s`;
        return `; nothing is granting: no worker seen ${since}; start one with \`permitq worker\` (if you started one, it has exited, or it works on another database than ${row.database}: its log says why, unless it was killed, and its \`worker started\` line names its database)`;
    }
    /**
     * Submits and waits for the grant: a Lease (`await using`, or `withLease`). Waits on LISTEN
     * on a connection of its own, reading the status every 250 ms as well, so a lost notification
     * costs latency, never a hang. At `timeoutMs`, or when `signal` aborts, the request is
     * cancelled (nothing waits on) and AcquireTimeout thrown; an error outcome throws its
     * RequestFailed subclass.
     */
    async acquire(externalId, permits, options = {}) {
        checkExternalId(externalId);
        checkOptions(options, ACQUIRE_OPTIONS);
        const { timeoutMs, signal, ...submitOptions } = options;
        const limit = timeoutMs ?? 30_000;
        const deadline = performance.now() + limit;
        let woken = () => { };
        const onNotification = () => woken();
        const onAbort = () => woken();
        signal?.addEventListener("abort", onAbort);
        let listener = null;
        let sent = 0;
        let current;
        let grantedBefore = false;
        // Whether the submit answered: only then may a request be left waiting.
        let submitted = false;
        try {
            // A lost listener costs latency, never a hang: the status is read every pollMs anyway.
            // Retried until the deadline, as the submit is: a database that is down when acquire
            // starts may be back before it.
            listener = this.listen ? await untilDeadline(deadline, signal, () => this.takeListener()) : null;
            listener?.on("notification", onNotification);
            sent = performance.now();
            current = await untilDeadline(deadline, signal, () => this.submit(externalId, permits, submitOptions));
            submitted = true;
            // A submit returns an ended request only when the external_id was used before.
            if (current.state === "error" || current.state === "released") {
                throw new PermitqError(`request ${externalId} was submitted before and has ended (${current.state} ` +
                    `${current.errorCode ?? current.releaseReason ?? ""}); this is that request: acquire under a new external_id`);
            }
            // Granted before this call (a retry): its lease may be older than `sent`.
            grantedBefore = current.state === "acquired";
            // The submit's answer says nothing of the standbys: an outcome it shows is confirmed.
            let barrier = true;
            let warned = false;
            const waitingSince = performance.now();
            let askedGranting = false;
            while (current.state === "new" || current.state === "in_progress") {
                // Waiting a while: whether any worker runs, said once (else silent until the deadline).
                if (!askedGranting && performance.now() - waitingSince >= SAY_NOTHING_GRANTING_AFTER_MS) {
                    askedGranting = true;
                    const granting = await this.nothingGranting().catch(() => "");
                    if (granting) {
                        process.emitWarning(`permitq: ${externalId} waits, and ${granting.replace(/^; /, "")}`, {
                            code: "PERMITQ_NOTHING_GRANTING",
                        });
                    }
                }
                const remaining = deadline - performance.now();
                if (remaining <= 0 || signal?.aborted) {
                    // What held it back, read just before it is cancelled (while nothing is granting, a
                    // row not examined yet speaks of a running worker: that says nothing more).
                    const granting = await this.nothingGranting().catch(() => "");
                    const why = ((await this.explain(externalId).catch(() => null))?.semaphores ?? [])
                        .filter((w) => w.reason && !(granting && w.reason.includes(NOT_EXAMINED)))
                        .map((w) => `${w.semaphore}: ${w.reason}${heldBy(w.holders)}`)
                        .join("; ");
                    const outcome = await this.release(externalId);
                    const ended = outcome === "cancelled" ? "it was cancelled, so it no longer waits"
                        : outcome === "released" ? "it was granted at that very moment and released at once"
                            : `releasing it answered ${outcome}`;
                    throw new AcquireTimeout(`request ${externalId} was not granted ${signal?.aborted ? "before the signal aborted" : `within ${limit} ms`}` +
                        `${why ? ` (${why})` : ""}${granting}; ${ended}: acquire again under a new external_id`, externalId);
                }
                await new Promise((resolve) => {
                    const timer = setTimeout(resolve, Math.min(this.pollMs, remaining));
                    woken = () => { clearTimeout(timer); resolve(); };
                });
                woken = () => { };
                // A read that fails is read again at the next tick, until the deadline.
                const read = await this.statusAndBarrier(externalId).catch((e) => {
                    if (!(e instanceof DatabaseUnavailable))
                        throw e;
                    if (!warned)
                        warnRetrying(e, deadline);
                    warned = true;
                    return null;
                });
                if (read)
                    [current, barrier] = read;
            }
            if (barrier)
                await this.confirmDurable(externalId, deadline);
        }
        catch (e) {
            // The wait failed or was given up: the request is cancelled, or it would be granted to
            // nobody and hold its permits (cancelled already, ended, or another's id: nothing to do).
            if (!(e instanceof AcquireTimeout || e instanceof RequestFailed || e instanceof ExternalIdTaken)) {
                const cancelled = await this.release(externalId).then(() => true, () => false);
                if (!cancelled && submitted && e instanceof DatabaseUnavailable) {
                    throw new DatabaseUnavailable(`${e.message}; ${leftWaiting(externalId)}`);
                }
            }
            throw e;
        }
        finally {
            signal?.removeEventListener("abort", onAbort);
            if (listener) {
                listener.off("notification", onNotification);
                this.giveBackListener(listener);
            }
        }
        if (current.state === "acquired") {
            // The lease's clock starts when the request was sent: after a long wait (a third of its
            // ttl) it would be handed over already near its end, so it starts at the grant just read,
            // and a heartbeat, at once, confirms it from its own send.
            const waitedLong = current.ttlSeconds != null && performance.now() - sent > current.ttlSeconds * 1000 / 3;
            const lease = new Lease(this, current, waitedLong ? performance.now() : sent);
            if (!leasesOf.has(this))
                leasesOf.set(this, new Map());
            leasesOf.get(this).set(externalId, new WeakRef(lease));
            if (grantedBefore || waitedLong)
                await lease.heartbeatNow();
            return lease;
        }
        if (current.state === "error")
            throw requestFailed(externalId, current.errorCode ?? "", current.errorDetail);
        throw new PermitqError(`request ${externalId} is ${current.state}: this external_id was granted and released before; submit under a new one`);
    }
    /**
     * What was read reached the synchronous standby (a failover cannot take it back), or
     * DatabaseUnavailable at the deadline (at least 1 s): a primary that lost its standby waits
     * for it forever, so the connection is then destroyed, not given back to the pool.
     */
    async confirmDurable(externalId, deadline) {
        const conn = await this.pool.connect().catch((e) => { throw translated(e); });
        try {
            const answer = await within(conn.query(SQL.confirmDurable), Math.max(deadline - performance.now(), 1000));
            if (answer === LATE) {
                conn.release(true);
                throw new DatabaseUnavailable(`the outcome of request ${externalId} did not reach the synchronous standby in time: this primary ` +
                    "may have lost its standby in a failover; the request was cancelled (or released): ask again");
            }
            conn.release();
        }
        catch (e) {
            if (e instanceof DatabaseUnavailable)
                throw e;
            conn.release(true);
            throw translated(e);
        }
    }
}
/** What `within` answers for a promise that did not settle in time. */
const LATE = Symbol("late");
/** `work`'s value, or LATE once `ms` pass first (`work` goes on, abandoned: its caller drops
 * the connection it runs on). */
async function within(work, ms) {
    let timer;
    const late = new Promise((resolve) => { timer = setTimeout(() => resolve(LATE), ms); });
    try {
        return await Promise.race([work, late]);
    }
    finally {
        clearTimeout(timer);
    }
}
/** `call`, again while the database is unavailable, until `deadline` or until `signal` aborts. */
/**
 * Said once when an acquire starts retrying a database that does not answer: without it the
 * caller sees nothing until the deadline, and a database that is down reads as a busy semaphore.
 * (Node prints warnings to stderr unless told not to.)
 */
/** How long an acquire waits before it asks, once, whether any worker runs. */
const SAY_NOTHING_GRANTING_AFTER_MS = 3_000;
function warnRetrying(e, deadline) {
    process.emitWarning(`permitq: the database did not answer (${e.message}); retrying until the acquire's deadline, ` +
        `${Math.round((deadline - performance.now()) / 1000)}s from now`, { code: "PERMITQ_RETRYING" });
}
/** What an acquire that gave up while the database did not answer says of its request. */
function leftWaiting(externalId) {
    return `request ${externalId} was submitted and could not be cancelled, so it may still be waiting: ` +
        `once the database answers, cancel it (client.release("${externalId}") or \`permitq release ${externalId}\`), ` +
        "or it may be granted with nobody to use it";
}
async function untilDeadline(deadline, signal, call) {
    let pause = 50;
    for (;;) {
        try {
            return await call();
        }
        catch (e) {
            if (!(e instanceof DatabaseUnavailable) || performance.now() + pause >= deadline || signal?.aborted)
                throw e;
            if (pause === 50)
                warnRetrying(e, deadline);
            await sleep(pause, signal);
            pause = Math.min(pause * 2, 1000);
        }
    }
}
/**
 * Permits held: heartbeats every third of its ttl, releases when disposed (`await using`, or
 * `withLease`), and says it is *lost* before the lease can have run out on the server: its
 * clock starts when the request or the last confirmed heartbeat was sent, never when the answer
 * came. Check `lease.isLost` or call `lease.check()` before each step; or pass `lease.signal`
 * (aborted when lost) to what you run under it. Write with `lease.fencingToken`.
 */
export class Lease {
    client;
    status;
    externalId;
    fencingToken;
    ttlSeconds;
    /** Aborted when the lease is lost; `signal.reason` says why. */
    signal;
    lost = new AbortController();
    validUntil;
    timer = null;
    watchdog = null;
    conn = null;
    released = null;
    constructor(client, status, sent) {
        this.client = client;
        this.status = status;
        this.externalId = status.externalId;
        this.fencingToken = status.fencingToken ?? 0n;
        this.ttlSeconds = status.ttlSeconds;
        this.signal = this.lost.signal;
        this.validUntil = this.ttlSeconds == null ? null : sent + this.ttlSeconds * 1000;
        if (this.ttlSeconds != null) {
            this.armWatchdog();
            this.schedule(this.ttlSeconds * 1000 / 3);
        }
    }
    /** Whether the lease is lost (or may be): stop acting on what the permits guarded. */
    get isLost() {
        if (!this.signal.aborted && this.validUntil != null && performance.now() >= this.lostAt()) {
            this.lose("no heartbeat was confirmed in time: the lease may run out");
        }
        return this.signal.aborted;
    }
    /** Throws LeaseLost once the lease is lost. */
    check() {
        if (this.isLost) {
            throw new LeaseLost(`lease of ${this.externalId} lost: ${String(this.signal.reason).replace(/^lease lost: /, "")}`);
        }
    }
    /** Reports how the use went so far, while it holds (`client.report`): whether it was kept. */
    report(report) {
        return this.client.report(this.externalId, report);
    }
    /** Stops heartbeating and gives the permits back (once): the release outcome; with `report`, reports. */
    release(report) {
        this.stopHeartbeats();
        if (!this.released)
            leasesOf.get(this.client)?.delete(this.externalId);
        this.released ??= this.client.release(this.externalId, report);
        return this.released;
    }
    /** Released through `client.release(id)`, not this lease: it holds nothing any more. */
    [GIVEN_BACK](outcome) {
        this.stopHeartbeats();
        this.released ??= Promise.resolve(outcome);
        this.lose(`released through client.release("${this.externalId}") (${outcome}): the permits are given back`);
    }
    async [Symbol.asyncDispose]() {
        await this.release();
    }
    /** No more heartbeats, nor the watchdog, nor the heartbeat connection. */
    stopHeartbeats() {
        for (const t of [this.timer, this.watchdog])
            if (t)
                clearTimeout(t);
        this.timer = this.watchdog = null;
        this.conn?.end().catch(() => { });
        this.conn = null;
    }
    lostAt() {
        return (this.validUntil ?? 0) - (this.ttlSeconds ?? 0) * 1000 * SAFETY_FRACTION;
    }
    lose(reason) {
        if (!this.signal.aborted)
            this.lost.abort(reason);
    }
    /** For a grant made before this acquire (its lease may be older than the call): the clock
     * starts at this heartbeat, or the lease is lost. */
    async heartbeatNow() {
        if (this.ttlSeconds == null)
            return;
        const sent = performance.now();
        try {
            await this.client.heartbeat(this.externalId);
        }
        catch (e) {
            this.lose(`the lease of a grant made before this acquire could not be confirmed: ${String(e)}`);
            return;
        }
        this.validUntil = sent + this.ttlSeconds * 1000;
        this.armWatchdog();
    }
    /** Aborts `signal` when the lease would be lost without another heartbeat, whatever a
     * heartbeat in flight is waiting for. */
    armWatchdog() {
        if (this.watchdog)
            clearTimeout(this.watchdog);
        this.watchdog = setTimeout(() => void this.isLost, Math.max(0, this.lostAt() - performance.now()));
        this.watchdog.unref();
    }
    schedule(pauseMs) {
        if (this.released || this.validUntil == null)
            return;
        this.timer = setTimeout(() => void this.beat(), pauseMs);
        this.timer.unref();
    }
    /** One heartbeat on the lease's own connection, bounded: one that does not answer in time is
     * left behind and the next attempt opens another. */
    async beat() {
        if (this.released || this.isLost)
            return;
        const every = (this.ttlSeconds ?? 0) * 1000 / 3;
        const sent = performance.now();
        try {
            if (!this.conn) {
                this.conn = this.client.connection("permitq-node-lease");
                await this.conn.connect();
                // A lease never released does not keep the process alive: it ends, and the lease
                // runs out on the server.
                this.conn.connection?.stream?.unref?.();
            }
            const conn = this.conn;
            const answer = await within(conn.query(SQL.leaseHeartbeat, [this.externalId]), Math.max(every / 2, 500));
            if (this.released)
                return;
            if (answer === LATE) {
                this.conn = null; // abandoned to its query
                conn.end().catch(() => { });
                this.schedule(0);
                return;
            }
            this.validUntil = sent + (this.ttlSeconds ?? 0) * 1000;
            this.armWatchdog();
            this.schedule(every);
        }
        catch (e) {
            const error = translated(e);
            if (error instanceof LeaseLost) {
                this.lose(error.message);
                return;
            }
            this.conn?.end().catch(() => { });
            this.conn = null;
            this.schedule(Math.min(every, 500)); // retried soon; the watchdog decides when it is lost
        }
    }
}
/** Runs `work` under a lease, releasing it afterwards (also when `work` throws). */
export async function withLease(client, externalId, permits, options, work) {
    const lease = await client.acquire(externalId, permits, options);
    try {
        return await work(lease);
    }
    finally {
        await lease.release();
    }
}
/** `, held by a (2 for 7.5s), b (1 for 3.0s)`: whom a timed-out request waited on (at most 3). */
function heldBy(holders) {
    if (holders.length === 0)
        return "";
    const named = holders.slice(0, 3).map((h) => `${h.externalId} (${h.count} for ${h.heldForSeconds.toFixed(1)}s)`);
    const more = holders.length > 3 ? ` and ${holders.length - 3} more` : "";
    return `, held by ${named.join(", ")}${more}`;
}
