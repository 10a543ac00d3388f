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
import pg from "pg";
import { type ErrorDetail } from "./errors.js";
export * from "./errors.js";
export { SQL } from "./sql.js";
/** A request as stored: where it is in its life, how it ended, its lease and token. */
export interface Status {
    id: bigint;
    externalId: string;
    permits: Record<string, number>;
    owner: string | null;
    state: "new" | "in_progress" | "acquired" | "released" | "error";
    errorCode: string | null;
    errorDetail: ErrorDetail | null;
    releaseReason: string | null;
    /** A bigint: tokens carry their epoch in the top 16 bits. */
    fencingToken: bigint | null;
    acquiredAt: Date | null;
    expiresAt: Date | null;
    releasedAt: Date | null;
    ttlSeconds: number | null;
    waitSeconds: number | null;
    priority: number;
    fairnessKey: string | null;
    fairnessWeight: number | null;
}
/** What a request asks for besides its permits. */
export interface SubmitOptions {
    owner?: string;
    /** The lease: heartbeat within it. */
    ttlSeconds?: number;
    /** How long it may wait (0: fail fast). */
    waitSeconds?: number;
    /** -100..100. */
    priority?: number;
    /** The tenant (or caller) whose share it counts in, on a semaphore served by fairness key. */
    fairnessKey?: string;
    /** Its key's weight there, 1..1000 (default 1): keys that wait are served in proportion. */
    fairnessWeight?: number;
}
/** How long `acquire` waits, and what stops it. */
export interface AcquireOptions extends SubmitOptions {
    /** At most this long (30 s by default); then the request is cancelled. */
    timeoutMs?: number;
    /** Aborting it cancels the request too. */
    signal?: AbortSignal;
}
/** One row of `explain`: what the request needs on one semaphore and what holds it back. */
export interface SemaphoreWait {
    semaphore: string;
    needs: number | null;
    capacity: number | null;
    free: number | null;
    shortfall: number | null;
    position: number | null;
    permitsAhead: number | null;
    reason: string | null;
    /** Who holds its permits where it is short of room, soonest to end first (at most 10; a
     * producer login sees its own). */
    holders: WaitHolder[];
    estimatedWaitSeconds: number | null;
    /** On a semaphore served by fairness key: what its key did to its place, in sentences (its
     * key and weight, how far back its key's turns placed it, behind which of its key's requests);
     * null elsewhere. */
    fairness: string | null;
}
/** A holder a waiting request waits on (`explain`). */
export interface WaitHolder {
    externalId: string;
    count: number;
    heldForSeconds: number;
    /** Null: held until released. */
    expiresInSeconds: number | null;
}
/** Why a request waits (`semaphores`), or how it ended (`outcome`). */
export interface Explanation {
    externalId: string;
    state: string;
    outcome: string | null;
    semaphores: SemaphoreWait[];
}
/** How a holder's use went, reported on release (or while it holds) to its adaptive semaphores. */
export interface Report {
    /** `ok`, `overloaded` (a 429, a timeout, a pool exhausted) or `failed`. */
    outcome: "ok" | "overloaded" | "failed";
    /** How long its calls took, if measured. */
    latencyMs?: number;
}
/** How a client tells a lease it was released through `client.release(id)`. */
declare const GIVEN_BACK: unique symbol;
export declare class Client {
    private readonly pool;
    private readonly listen;
    /** How often a waiting acquire reads its status without a notification. */
    private readonly pollMs;
    /** How to connect: the caller's config, the local socket filled in, `listen` taken out. */
    private readonly connect;
    /**
     * `config` as node-postgres takes it; `listen: false` waits by reading the status only (through
     * a pooler in transaction mode, where LISTEN does not work; no statement is prepared either);
     * `pollMs` (250): how often a waiting acquire reads its status besides the events.
     */
    constructor(config: pg.PoolConfig & {
        listen?: boolean;
        pollMs?: number;
    });
    /** A connection of its own (a LISTEN, a lease's heartbeats), not from the pool. */
    connection(applicationName: string): pg.Client;
    /** Closes the pool and the idle LISTEN connections. */
    end(): Promise<void>;
    /** LISTEN connections between acquires (one per acquire waiting at once): opening one for
     * every acquire cost more than the wait. One idle for 10 s is closed. */
    private readonly listeners;
    private readonly brokenListeners;
    /** A connection that LISTENs on the events: an idle one, else a new one. */
    private takeListener;
    /** Keeps a sound listener for the next acquire (events that reach it meanwhile only make that
     * acquire read its status once more), and closes it if no acquire takes it within 10 s. */
    private giveBackListener;
    private query;
    /** Where this client works, as messages name it: `database app at localhost:5432 as app`. */
    private database;
    /** Submits a request, idempotent by `externalId` (other parameters throw ExternalIdTaken). */
    submit(externalId: string, permits: Record<string, number>, options?: SubmitOptions): Promise<Status>;
    /** The request, or null for an unknown id (or another login's, for a producer). */
    status(externalId: string): Promise<Status | null>;
    /** `status`, and whether an outcome read needs `confirmDurable` here. */
    private statusAndBarrier;
    /**
     * Gives the permits back: `released`, `already_released`, `cancelled`, `not_acquired`, `unknown`.
     * With `report.outcome` (`ok`, `overloaded`, `failed`) and an optional `latencyMs`, reports how the
     * use went to the adaptive semaphores it held.
     */
    release(externalId: string, report?: Report): Promise<string>;
    /** Extends the lease (to now + `extendSeconds`, else its ttl); throws LeaseLost when it is gone. */
    heartbeat(externalId: string, extendSeconds?: number): Promise<Date | null>;
    /**
     * Reports how the holder's use went so far, while it still holds, to the adaptive semaphores it
     * holds. Whether it was kept: `false` when no request has the id, when it is not held, or when
     * none of its semaphores is adaptive. Until a cadence applies it, a later report replaces it
     * unless it says less (ok < failed < overloaded).
     */
    report(externalId: string, report: Report): Promise<boolean>;
    /** Why the request waits, per semaphore; or how it ended. Null for an unknown id. */
    explain(externalId: string): Promise<Explanation | null>;
    /** Creates or changes a semaphore (admins); an option left out keeps its setting. */
    /**
     * Creates or changes a semaphore (admins); a setting left out is kept. `adaptive`: an algorithm
     * (`aimd` or `gradient`) with a floor and a ceiling lets the workers set the capacity from the
     * holders' reports (`lease.release({ outcome })`); `false` fixes it again.
     */
    setCapacity(name: string, capacity: number, options?: {
        fair?: boolean;
        perSeconds?: number;
        maxInstances?: number;
        parent?: string;
        guarantee?: number;
        adaptive?: {
            algorithm: "aimd" | "gradient";
            floor: number;
            ceiling: number;
        } | false;
    }): Promise<{
        name: string;
        capacity: number;
        used: number;
    }>;
    /** `; nothing is granting: ...` when no worker runs, else empty. */
    private nothingGranting;
    /**
     * Submits and waits for the grant: a Lease (`await using`, or `withLease`). Waits on LISTEN
     * on a connection of its own, reading the status every 250 ms as well, so a lost notification
     * costs latency, never a hang. At `timeoutMs`, or when `signal` aborts, the request is
     * cancelled (nothing waits on) and AcquireTimeout thrown; an error outcome throws its
     * RequestFailed subclass.
     */
    acquire(externalId: string, permits: Record<string, number>, options?: AcquireOptions): Promise<Lease>;
    /**
     * What was read reached the synchronous standby (a failover cannot take it back), or
     * DatabaseUnavailable at the deadline (at least 1 s): a primary that lost its standby waits
     * for it forever, so the connection is then destroyed, not given back to the pool.
     */
    private confirmDurable;
}
/**
 * Permits held: heartbeats every third of its ttl, releases when disposed (`await using`, or
 * `withLease`), and says it is *lost* before the lease can have run out on the server: its
 * clock starts when the request or the last confirmed heartbeat was sent, never when the answer
 * came. Check `lease.isLost` or call `lease.check()` before each step; or pass `lease.signal`
 * (aborted when lost) to what you run under it. Write with `lease.fencingToken`.
 */
export declare class Lease implements AsyncDisposable {
    private readonly client;
    readonly status: Status;
    readonly externalId: string;
    readonly fencingToken: bigint;
    readonly ttlSeconds: number | null;
    /** Aborted when the lease is lost; `signal.reason` says why. */
    readonly signal: AbortSignal;
    private readonly lost;
    private validUntil;
    private timer;
    private watchdog;
    private conn;
    private released;
    constructor(client: Client, status: Status, sent: number);
    /** Whether the lease is lost (or may be): stop acting on what the permits guarded. */
    get isLost(): boolean;
    /** Throws LeaseLost once the lease is lost. */
    check(): void;
    /** Reports how the use went so far, while it holds (`client.report`): whether it was kept. */
    report(report: Report): Promise<boolean>;
    /** Stops heartbeating and gives the permits back (once): the release outcome; with `report`, reports. */
    release(report?: Report): Promise<string>;
    /** Released through `client.release(id)`, not this lease: it holds nothing any more. */
    [GIVEN_BACK](outcome: string): void;
    [Symbol.asyncDispose](): Promise<void>;
    /** No more heartbeats, nor the watchdog, nor the heartbeat connection. */
    private stopHeartbeats;
    private lostAt;
    private lose;
    /** For a grant made before this acquire (its lease may be older than the call): the clock
     * starts at this heartbeat, or the lease is lost. */
    heartbeatNow(): Promise<void>;
    /** Aborts `signal` when the lease would be lost without another heartbeat, whatever a
     * heartbeat in flight is waiting for. */
    private armWatchdog;
    private schedule;
    /** One heartbeat on the lease's own connection, bounded: one that does not answer in time is
     * left behind and the next attempt opens another. */
    private beat;
}
/** Runs `work` under a lease, releasing it afterwards (also when `work` throws). */
export declare function withLease<T>(client: Client, externalId: string, permits: Record<string, number>, options: AcquireOptions, work: (lease: Lease) => Promise<T>): Promise<T>;
