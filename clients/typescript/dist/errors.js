/** permitq's errors as types: nothing a caller has to decode from a SQLSTATE. */
/** Every error this package throws. */
export class PermitqError extends Error {
    name = "PermitqError";
}
/** The database could not be reached or went away. Retryable: submit is idempotent. */
export class DatabaseUnavailable extends PermitqError {
    name = "DatabaseUnavailable";
}
/** The database refused an argument (SQLSTATE 22023); `field` names it when it can. */
export class InvalidInput extends PermitqError {
    field;
    name = "InvalidInput";
    constructor(message, field) {
        super(message);
        this.field = field;
    }
}
/** Another login's request, or a role this login lacks (SQLSTATE 42501). */
export class NotOwner extends PermitqError {
    name = "NotOwner";
}
/** This login lacks the permitq role the call needs (SQLSTATE 42501, "permission denied"): the message names the role. A NotOwner, as it always was. */
export class RoleMissing extends NotOwner {
    name = "RoleMissing";
}
/** The external_id was submitted before with other parameters (SQLSTATE 23505). */
export class ExternalIdTaken extends PermitqError {
    name = "ExternalIdTaken";
}
/** The lease is gone (SQLSTATE 55000, or no heartbeat got through in time). */
export class LeaseLost extends PermitqError {
    name = "LeaseLost";
}
/** A heartbeat on a request still waiting to be granted: it has no lease yet (SQLSTATE 55000). */
export class NoLeaseYet extends LeaseLost {
    name = "NoLeaseYet";
}
/** A heartbeat on an external_id no request has: mistyped, or removed by retention long after it ended (SQLSTATE 55000). */
export class UnknownRequest extends LeaseLost {
    name = "UnknownRequest";
}
/**
 * The server refused the login: no such role or database, a wrong or missing password, or no
 * pg_hba.conf entry. Retrying will not help: fix the URL or the server's settings.
 */
export class LoginRejected extends PermitqError {
    name = "LoginRejected";
}
/** Not granted before the deadline (or the signal aborted); the request was cancelled. */
export class AcquireTimeout extends PermitqError {
    externalId;
    name = "AcquireTimeout";
    constructor(message, externalId) {
        super(message);
        this.externalId = externalId;
    }
}
/** The request ended in `error`; one subclass per `errorCode`. */
export class RequestFailed extends PermitqError {
    externalId;
    errorCode;
    errorDetail;
    name = "RequestFailed";
    constructor(externalId, errorCode, errorDetail) {
        super(`request ${externalId} ended in error ${errorCode}: ${explained(errorCode, errorDetail)}`);
        this.externalId = externalId;
        this.errorCode = errorCode;
        this.errorDetail = errorDetail;
    }
}
/** A named semaphore does not exist (and no template matches it). */
export class UnknownSemaphore extends RequestFailed {
    name = "UnknownSemaphore";
}
/** A count is larger than its semaphore's (or a parent's) capacity. */
export class ExceedsCapacity extends RequestFailed {
    name = "ExceedsCapacity";
}
/** Submitted with wait 0, and there was no room at that moment. */
export class NoCapacity extends RequestFailed {
    name = "NoCapacity";
}
/** It waited its `wait` and was not granted. */
export class WaitTimedOut extends RequestFailed {
    name = "WaitTimedOut";
}
/** It was released (cancelled) while still waiting. */
export class Cancelled extends RequestFailed {
    name = "Cancelled";
}
/** It names a new instance of a template that has its `max_instances` already. */
export class TooManyInstances extends RequestFailed {
    name = "TooManyInstances";
}
/** The stored row could not be decided. */
export class InvalidRequest extends RequestFailed {
    name = "InvalidRequest";
}
const BY_CODE = {
    unknown_semaphore: UnknownSemaphore,
    exceeds_capacity: ExceedsCapacity,
    no_capacity: NoCapacity,
    timeout: WaitTimedOut,
    cancelled: Cancelled,
    too_many_instances: TooManyInstances,
    invalid: InvalidRequest,
};
/** The typed error of a request that ended with `code`. */
export function requestFailed(externalId, code, detail) {
    const Type = BY_CODE[code] ?? RequestFailed;
    return new Type(externalId, code, detail ?? {});
}
function explained(code, d) {
    return explainedCode(code, d) + turnKept(d);
}
/** A request that stopped waiting on a semaphore served by fairness key: its turn stays taken. */
function turnKept(d) {
    const on = d.turn_kept_on ?? [];
    return on.length
        ? `; its turn on ${on.join(", ")} stays taken for its fairness key until the line passes it, so the key's next request there is placed behind it (each try placed in line takes a turn, a refused fail-fast try too; \`permitq explain\` of the next one says how far back it is placed)`
        : "";
}
function explainedCode(code, d) {
    const name = d.semaphore ?? "?";
    switch (code) {
        case "unknown_semaphore":
            // A template, as the CLI says it: never granted itself.
            if (name.endsWith("*") && !d.named) {
                return (`${name} is a template, which is never granted itself: name an instance of it ` +
                    `(${name.slice(0, -1)}NAME, made at its first grant), under a new external_id`);
            }
            {
                // As the CLI says it: a missing parent, or neither a semaphore nor a template.
                const what = d.named
                    ? `${d.named}'s parent ${name} does not exist`
                    : `no semaphore named ${name}, and no template matches it`;
                return d.similar?.length
                    ? `${what}; did you mean ${d.similar.join(" or ")}? (submit again under a new external_id; ` +
                        `or, if ${name} is a new one, create it first: \`permitq semaphore set ${name} CAPACITY\`)`
                    : `${what}; create it with \`permitq semaphore set ${name} CAPACITY\` (or a template NAME* ` +
                        "that matches it), then submit again under a new external_id";
            }
        case "exceeds_capacity":
            return exceedsCapacity(name, d);
        case "no_capacity":
        case "timeout":
            return d.semaphore
                ? `${name}=${d.count}, ${d.free} of ${d.capacity} free; submit again under a new external_id with a longer wait`
                : "submit again under a new external_id with a longer wait";
        case "too_many_instances": {
            const idle = d.idle_instances ?? [];
            const free = idle.length
                ? `${idle.join(", ")} hold${idle.length === 1 ? "s" : ""} nothing: delete one (\`permitq semaphore delete ${idle[0]}\`)`
                : "once one is idle, delete it (`permitq semaphore delete NAME`)";
            const raise = d.parent_needs
                ? `or raise the bound once ${String(d.parent)} has capacity ${d.parent_needs}`
                : "or raise the bound (`--max-instances`)";
            if (d.max_instances === 0 && !d.instances) {
                return `template ${d.template} has max_instances 0: it makes no instance at all; ${raise}; then submit again under a new external_id`;
            }
            const has = typeof d.instances === "number" && typeof d.max_instances === "number" && d.instances > d.max_instances
                ? `has ${d.instances} instances, more than its max_instances of ${d.max_instances} (lowered below them: they stay until deleted or idle)`
                : `has its max_instances of ${String(d.max_instances)} already`;
            return `template ${d.template} ${has} (\`permitq semaphore show '${d.template}'\` lists them); ${free}, ${raise}; then submit again under a new external_id`;
        }
        case "cancelled":
            return d.revoked_by
                ? `revoked by ${d.revoked_by} (\`permitq revoke\`) while it was still waiting; submit again under a new external_id if it is still wanted`
                : code;
        default:
            return String(d.problem ?? code);
    }
}
/** The role a refused function needs, as the CLI says it. */
function roleHint(message) {
    const fn = /permission denied for function (\w+)/.exec(message)?.[1] ?? "";
    const role = ["set_capacity", "delete_semaphore", "revoke"].includes(fn)
        ? "permitq_admin"
        : ["submit", "release", "cancel", "heartbeat", "fence"].includes(fn)
            ? "permitq_producer (or permitq_admin)"
            : "permitq_producer";
    return `; this needs the role ${role}: use a login that has it, or a DBA runs GRANT ${role.split(" ")[0]} TO <your login>`;
}
/**
 * A node-postgres error as this package's type, with the server's message; `where` names the
 * database the client works in (`database app at localhost:5432 as app`), for a missing schema.
 */
export function translated(e, where) {
    if (e instanceof PermitqError)
        return e;
    const err = e;
    // The server's message with its detail and hint, as the Python client says it.
    const message = [
        [err.message ?? String(e), err.detail].filter((part) => part).join(": "),
        err.hint ? ` (${err.hint})` : "",
    ]
        .join("")
        .replace(/\s+/g, " ");
    const code = err.code ?? "";
    // A server's error has a severity; a socket's (EPIPE, ECONNRESET) has only a code.
    const sqlstate = /^[0-9A-Z]{5}$/.test(code) && "severity" in e;
    if (/password must be a string/i.test(message)) {
        return new LoginRejected(`the server asks for a password and none was given (${message}): put it in the URL, postgres://user:password@host/db, or set PGPASSWORD; ` +
            "or, on the database's own machine, connect by its local socket (host=/var/run/postgresql), " +
            "where PostgreSQL may know the OS user without one");
    }
    if (code === "28P01") {
        return new LoginRejected(`${message}: the password was given and refused: check it (in the URL, percent-encode @ : / # % as %40 %3A %2F %23 %25)`);
    }
    if (code === "3D000") {
        return new LoginRejected(`${message}: create it (createdb, or CREATE DATABASE as a superuser), or name another in the URL, postgres://user@host/db`);
    }
    if (code === "28000") {
        return new LoginRejected(`${message} (check the URL's user and database; a role that exists may still need a pg_hba.conf entry for this host)`);
    }
    if (/no PostgreSQL user name/i.test(message)) {
        return new LoginRejected(`${message} (name the user in the URL: postgres://user@host/db)`);
    }
    const connection = !sqlstate && (code !== "" || /connection|connect|terminated|timeout/i.test(message));
    if (connection || code.startsWith("08") || code.startsWith("57P") || code === "53300") {
        return new DatabaseUnavailable(`${message} (is PostgreSQL up and the URL right? Retrying is safe: a submit under the same external_id is never made twice)`);
    }
    if (!sqlstate)
        return e instanceof Error ? e : new PermitqError(message);
    switch (code) {
        case "22023": {
            const field = message.startsWith("invalid ") ? message.slice(8).split(":")[0].trim() : null;
            return new InvalidInput(message, field);
        }
        case "22003": // a number out of its column's range
        case "22P02": // a number that is not one (1.5 for a count)
            return new InvalidInput(`${message} (a count, capacity or priority must be a whole number in range)`, null);
        case "42501":
            return message.startsWith("permission denied for")
                ? new RoleMissing(message + roleHint(message))
                : new NotOwner(message);
        case "23505":
            return new ExternalIdTaken(message);
        case "55000":
            if (message.startsWith("no lease yet"))
                return new NoLeaseYet(message);
            return message.startsWith("no request named") ? new UnknownRequest(message) : new LeaseLost(message);
        case "3F000":
        case "42883":
            return new PermitqError(`${message} (the permitq schema is missing or older than this client${where ? ` in ${where}` : ""}: ` +
                "run `permitq migrate` there; or, if permitq was migrated into another database, fix the URL)");
        default:
            return new PermitqError(message);
    }
}
/** As the Rust client and the CLI say it: where, the bound, and the commands that fix it. */
function exceedsCapacity(name, d) {
    const count = d.count ?? 0;
    const capacity = d.capacity ?? 0;
    const at = d.named
        ? `${d.named} takes ${count} from its parent ${name}, which`
        : `${name}=${count} but ${name}`;
    const bound = d.per ? `allows ${capacity} grants per ${d.per}` : `has capacity ${capacity}`;
    // An instance's capacity is set on its template (a change there reaches it).
    const target = d.template && !d.named ? `'${d.template}'` : name;
    if (d.adaptive && typeof d.adaptive === "object") {
        return adaptiveExceeded(at, name, count, capacity, d.adaptive);
    }
    const ask = capacity > 0 ? `ask for at most ${capacity}, or ` : "";
    return (`${at} ${bound}: it can never be granted; ${ask}raise the capacity ` +
        `(\`permitq semaphore set ${target} ${count}\`); then submit again under a new external_id`);
}
/**
 * An adaptive semaphore's exceeds_capacity, as the Rust client and the CLI say it: the workers
 * moved its capacity (or its ceiling is the bound), and what to ask for instead.
 */
function adaptiveExceeded(at, name, count, capacity, a) {
    const bounds = `adaptive, ${String(a.algorithm)} from ${String(a.floor)} to ${String(a.ceiling)}`;
    if (typeof a.ceiling === "number" && count > a.ceiling) {
        return (`${at} is ${bounds} (its capacity is ${capacity} now): it can never be granted; ask for ` +
            `at most ${a.ceiling}, or raise its ceiling (\`permitq semaphore set ${name} ${capacity} ` +
            `--adaptive ${String(a.algorithm)} --floor ${String(a.floor)} --ceiling ${count}\`); then submit again under a ` +
            "new external_id");
    }
    if (typeof a.floor === "number" && count <= a.floor) {
        // Set below its floor by hand: the next cadence brings it back within its bounds.
        return (`${at} has capacity ${capacity} now, below its floor ${a.floor} (${bounds}): it was set by hand, ` +
            "and the workers bring it back within its bounds at their next cadence; submit again under a " +
            `new external_id (\`permitq semaphore show ${name}\` shows the capacity)`);
    }
    const moved = a.from !== undefined && a.from !== null
        ? `has capacity ${capacity} now: the workers backed it off from ${a.from} (${bounds}) on ` +
            "its holders' reports, and it may grow back"
        : `has capacity ${capacity} now (${bounds}: the workers move it)`;
    // A floor raised to the ceiling leaves it nothing to adapt: said.
    const fixed = Number(count) === Number(a.ceiling)
        ? `: with floor and ceiling equal it stays at ${count}, no longer adapting`
        : "";
    return (`${at} ${moved}; a request is decided against the capacity it finds, so ask for at most ` +
        `${String(a.floor)} (its floor, which always fits), or raise the floor (\`permitq semaphore set ${name} ` +
        `${count} --adaptive ${String(a.algorithm)} --floor ${count} --ceiling ${String(a.ceiling)}\`${fixed}); then submit ` +
        "again under a new external_id");
}
