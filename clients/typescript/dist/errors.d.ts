/** permitq's errors as types: nothing a caller has to decode from a SQLSTATE. */
/** Every error this package throws. */
export declare class PermitqError extends Error {
    name: string;
}
/** The database could not be reached or went away. Retryable: submit is idempotent. */
export declare class DatabaseUnavailable extends PermitqError {
    name: string;
}
/** The database refused an argument (SQLSTATE 22023); `field` names it when it can. */
export declare class InvalidInput extends PermitqError {
    readonly field: string | null;
    name: string;
    constructor(message: string, field: string | null);
}
/** Another login's request, or a role this login lacks (SQLSTATE 42501). */
export declare class NotOwner extends PermitqError {
    name: string;
}
/** This login lacks the permitq role the call needs (SQLSTATE 42501, "permission denied"): the message names the role. A NotOwner, as it always was. */
export declare class RoleMissing extends NotOwner {
    name: string;
}
/** The external_id was submitted before with other parameters (SQLSTATE 23505). */
export declare class ExternalIdTaken extends PermitqError {
    name: string;
}
/** The lease is gone (SQLSTATE 55000, or no heartbeat got through in time). */
export declare class LeaseLost extends PermitqError {
    name: string;
}
/** A heartbeat on a request still waiting to be granted: it has no lease yet (SQLSTATE 55000). */
export declare class NoLeaseYet extends LeaseLost {
    name: string;
}
/** A heartbeat on an external_id no request has: mistyped, or removed by retention long after it ended (SQLSTATE 55000). */
export declare class UnknownRequest extends LeaseLost {
    name: string;
}
/**
 * The server refused the login: no such role or database, a wrong or missing password, or no
 * pg_hba.conf entry. Retrying will not help: fix the URL or the server's settings.
 */
export declare class LoginRejected extends PermitqError {
    name: string;
}
/** Not granted before the deadline (or the signal aborted); the request was cancelled. */
export declare class AcquireTimeout extends PermitqError {
    readonly externalId: string;
    name: string;
    constructor(message: string, externalId: string);
}
/** What an errored request hit: the semaphore, its count and the bound. */
export type ErrorDetail = Record<string, unknown> & {
    semaphore?: string;
    /** The semaphore the request named, when `semaphore` is its parent. */
    named?: string;
    /** A rate-limited semaphore's window (its capacity is grants per window). */
    per?: string;
    count?: number;
    capacity?: number;
    free?: number;
    similar?: string[];
    template?: string;
    max_instances?: number;
    /** How many instances the template has (more than max_instances after a lowered bound). */
    instances?: number;
    idle_instances?: string[];
    parent?: string;
    parent_needs?: number;
    /** The admin login whose `permitq revoke` ended it (while it waited: `cancelled`; while it held: released `revoked`). */
    revoked_by?: string;
    /** For `cancelled` and `timeout`: the semaphores served by fairness key where its turn stays taken. */
    turn_kept_on?: string[];
};
/** The request ended in `error`; one subclass per `errorCode`. */
export declare class RequestFailed extends PermitqError {
    readonly externalId: string;
    readonly errorCode: string;
    readonly errorDetail: ErrorDetail;
    name: string;
    constructor(externalId: string, errorCode: string, errorDetail: ErrorDetail);
}
/** A named semaphore does not exist (and no template matches it). */
export declare class UnknownSemaphore extends RequestFailed {
    name: string;
}
/** A count is larger than its semaphore's (or a parent's) capacity. */
export declare class ExceedsCapacity extends RequestFailed {
    name: string;
}
/** Submitted with wait 0, and there was no room at that moment. */
export declare class NoCapacity extends RequestFailed {
    name: string;
}
/** It waited its `wait` and was not granted. */
export declare class WaitTimedOut extends RequestFailed {
    name: string;
}
/** It was released (cancelled) while still waiting. */
export declare class Cancelled extends RequestFailed {
    name: string;
}
/** It names a new instance of a template that has its `max_instances` already. */
export declare class TooManyInstances extends RequestFailed {
    name: string;
}
/** The stored row could not be decided. */
export declare class InvalidRequest extends RequestFailed {
    name: string;
}
/** The typed error of a request that ended with `code`. */
export declare function requestFailed(externalId: string, code: string, detail: ErrorDetail | null): RequestFailed;
/**
 * A node-postgres error as this package's type, with the server's message; `where` names the
 * database the client works in (`database app at localhost:5432 as app`), for a missing schema.
 */
export declare function translated(e: unknown, where?: string): Error;
