"""permitq's errors as types: nothing a caller has to decode from a SQLSTATE."""

from __future__ import annotations

import re
from typing import Any

import psycopg
import psycopg.errors


class PermitqError(Exception):
    """Every error this package raises."""


class DatabaseUnavailable(PermitqError):
    """The database could not be reached or went away. Retryable: submit is idempotent by its
    external_id, so running the same call again is safe."""


class InvalidInput(PermitqError):
    """The database refused an argument (SQLSTATE 22023); `field` names it when it can."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class NotOwner(PermitqError):
    """The request belongs to another login, or this login lacks the role (SQLSTATE 42501)."""


class RoleMissing(NotOwner):
    """This login lacks the permitq role the call needs (SQLSTATE 42501, "permission denied"):
    the message names the role. A NotOwner, as it always was."""


class ExternalIdTaken(PermitqError):
    """The external_id was submitted before with other parameters (SQLSTATE 23505): submit
    under a new one."""


class LeaseLost(PermitqError):
    """The lease is gone (SQLSTATE 55000, or the heartbeats stopped getting through): stop
    acting on what the permits guarded."""


class NoLeaseYet(LeaseLost):
    """A heartbeat on a request still waiting to be granted: it has no lease yet (SQLSTATE 55000,
    hence a LeaseLost too). Heartbeat once it is acquired."""


class UnknownRequest(LeaseLost):
    """A heartbeat on an external_id no request has: mistyped, or removed by retention long after
    it ended (SQLSTATE 55000, hence a LeaseLost too). Check the id."""


class LoginRejected(PermitqError):
    """The server refused the login: no such role or database, a missing or wrong password, or
    no pg_hba.conf entry. Retrying will not help: fix the URL or the server's settings."""


class AcquireTimeout(PermitqError):
    """The request was not granted before the deadline; it was cancelled, so it no longer waits."""

    def __init__(self, message: str, external_id: str) -> None:
        super().__init__(message)
        self.external_id = external_id


class RequestFailed(PermitqError):
    """The request ended in `error`: `error_code` says why and `error_detail` (a dict) names
    the semaphore and the bound it hit. One subclass per code."""

    code = ""

    def __init__(self, external_id: str, error_code: str, detail: dict[str, Any] | None) -> None:
        self.external_id = external_id
        self.error_code = error_code
        self.error_detail = detail or {}
        super().__init__(f"request {external_id} ended in error {error_code}: {_explained(error_code, self.error_detail)}")


class UnknownSemaphore(RequestFailed):
    """A named semaphore does not exist (and no template matches it)."""

    code = "unknown_semaphore"


class ExceedsCapacity(RequestFailed):
    """A count is larger than its semaphore's (or a parent's) capacity: it can never be granted."""

    code = "exceeds_capacity"


class NoCapacity(RequestFailed):
    """Submitted with wait 0 (fail fast), and there was no room at that moment."""

    code = "no_capacity"


class WaitTimedOut(RequestFailed):
    """It waited its `wait` and was not granted."""

    code = "timeout"


class Cancelled(RequestFailed):
    """It was released (cancelled) while still waiting."""

    code = "cancelled"


class TooManyInstances(RequestFailed):
    """It names a new instance of a template that has its `max_instances` already."""

    code = "too_many_instances"


class InvalidRequest(RequestFailed):
    """The stored row could not be decided."""

    code = "invalid"


_BY_CODE = {c.code: c for c in (UnknownSemaphore, ExceedsCapacity, NoCapacity, WaitTimedOut, Cancelled, TooManyInstances, InvalidRequest)}


def request_failed(external_id: str, error_code: str, detail: dict[str, Any] | None) -> RequestFailed:
    """The typed error for a request that ended with `error_code`."""
    return _BY_CODE.get(error_code, RequestFailed)(external_id, error_code, detail)


def _explained(code: str, d: dict[str, Any]) -> str:
    return _explained_code(code, d) + _turn_kept(d)


def _turn_kept(d: dict[str, Any]) -> str:
    """A request that stopped waiting on a semaphore served by fairness key: its turn stays taken."""
    on = d.get("turn_kept_on") or []
    if not on:
        return ""
    return (
        f"; its turn on {', '.join(on)} stays taken for its fairness key until the line passes it, "
        "so the key's next request there is placed behind it (each try placed in line takes a turn, a refused fail-fast try too; `permitq explain` of the next one says how far back it is placed)"
    )


def _explained_code(code: str, d: dict[str, Any]) -> str:
    name = d.get("semaphore", "?")
    if code == "unknown_semaphore" and name.endswith("*") and not d.get("named"):
        # A template, as the CLI says it: never granted itself.
        return (
            f"{name} is a template, which is never granted itself: name an instance of it "
            f"({name[:-1]}NAME, made at its first grant), under a new external_id"
        )
    if code == "unknown_semaphore":
        # As the CLI says it: a missing parent, or neither a semaphore nor a template.
        named = d.get("named")
        what = (
            f"{named}'s parent {name} does not exist"
            if named
            else f"no semaphore named {name}, and no template matches it"
        )
        similar = d.get("similar") or []
        if similar:
            return (
                f"{what}; did you mean {' or '.join(similar)}? (submit again under a new external_id; "
                f"or, if {name} is a new one, create it first: `permitq semaphore set {name} CAPACITY`)"
            )
        return (
            f"{what}; create it with `permitq semaphore set {name} CAPACITY` (or a template NAME* "
            f"that matches it), then submit again under a new external_id"
        )
    if code == "exceeds_capacity":
        return _exceeds_capacity(name, d)
    if code in ("no_capacity", "timeout") and "semaphore" in d:
        return f"{name}={d.get('count')}, {d.get('free')} of {d.get('capacity')} free; submit again under a new external_id with a longer wait"
    if code == "too_many_instances":
        template = d.get("template")
        idle = d.get("idle_instances") or []
        free = (
            f"{', '.join(idle)} hold{'s' if len(idle) == 1 else ''} nothing: delete one "
            f"(`permitq semaphore delete {idle[0]}`)"
            if idle
            else "once one is idle, delete it (`permitq semaphore delete NAME`)"
        )
        raise_ = (
            f"or raise the bound once {d.get('parent')} has capacity {d['parent_needs']}"
            if d.get("parent_needs")
            else "or raise the bound (`--max-instances`)"
        )
        bound, instances = d.get("max_instances"), d.get("instances")
        if bound == 0 and not instances:
            return (
                f"template {template} has max_instances 0: it makes no instance at all; "
                f"{raise_}; then submit again under a new external_id"
            )
        has = (
            f"has {instances} instances, more than its max_instances of {bound} (lowered below "
            "them: they stay until deleted or idle)"
            if isinstance(instances, int) and isinstance(bound, int) and instances > bound
            else f"has its max_instances of {bound} already"
        )
        return (
            f"template {template} {has} "
            f"(`permitq semaphore show '{template}'` lists them); {free}, {raise_}; "
            "then submit again under a new external_id"
        )
    if code == "invalid":
        return str(d.get("problem", "the stored row cannot be decided"))
    if code == "cancelled" and d.get("revoked_by"):
        return (
            f"revoked by {d['revoked_by']} (`permitq revoke`) while it was still waiting; "
            "submit again under a new external_id if it is still wanted"
        )
    return code


_ROLES = {
    "set_capacity": "permitq_admin",
    "delete_semaphore": "permitq_admin",
    "revoke": "permitq_admin",
    "submit": "permitq_producer (or permitq_admin)",
    "release": "permitq_producer (or permitq_admin)",
    "cancel": "permitq_producer (or permitq_admin)",
    "heartbeat": "permitq_producer (or permitq_admin)",
    "fence": "permitq_producer (or permitq_admin)",
}


def _message(e: psycopg.Error) -> str:
    """The server's message with its detail and hint, without PL/pgSQL's CONTEXT lines."""
    diag = e.diag
    if diag.message_primary:
        parts = [diag.message_primary]
        if diag.message_detail:
            parts.append(diag.message_detail)
        text = ": ".join(parts)
        if diag.message_hint:
            text += f" ({diag.message_hint})"
    else:
        text = _once_per_attempt(str(e))
    return " ".join(text.split())


def _once_per_attempt(text: str) -> str:
    """libpq's message with each attempt's failure once: it tries a host twice (with and without
    TLS, or over IPv4 and IPv6) and says the same thing for both."""
    attempts: list[str] = []
    for attempt in re.split(r"(?=connection to server )", text):
        attempt = " ".join(attempt.split())
        if attempt and attempt not in attempts:
            attempts.append(attempt)
    return " ".join(attempts)


def _looked_in(info: Any) -> str:
    """Where an error happened, from a connection's `info`: " in database app at host:5432 as
    app" (nothing without one)."""
    try:
        return f" in database {info.dbname} at {info.host}:{info.port} as {info.user}"
    except Exception:  # noqa: BLE001 - no connection at hand: the message goes without it
        return ""


def translated(e: psycopg.Error, info: Any = None) -> PermitqError:
    """A psycopg error as this package's type, with the server's message."""
    message = _message(e)
    if isinstance(e, psycopg.OperationalError) and e.sqlstate is None:
        # The server answered and refused: a wrong URL or login, which retrying will not mend.
        if "no password supplied" in message or "password is required" in message:
            return LoginRejected(
                f"the server asks for a password and none was given ({message}): put it in the URL, "
                "postgres://user:password@host/db, or set PGPASSWORD; or, on the database's own machine, "
                "connect by its local socket, postgres:///DB, where PostgreSQL may know the OS user without one"
            )
        if "password authentication failed" in message:
            return LoginRejected(
                f"{message}: the password was given and refused: check it (in the URL, percent-encode "
                "@ : / # % as %40 %3A %2F %23 %25)"
            )
        if "database" in message and "does not exist" in message:
            return LoginRejected(
                f"{message}: create it (createdb, or CREATE DATABASE as a superuser), or name "
                "another in the URL, postgres://user@host/db"
            )
        if any(r in message for r in ("does not exist", "no pg_hba.conf entry")):
            return LoginRejected(
                f"{message} (check the URL's user and database; a role that exists may still need a "
                "pg_hba.conf entry for this host)"
            )
        if "invalid" in message and "value" in message:
            return InvalidInput(f"invalid database URL: {message}", "database URL")
        return DatabaseUnavailable(
            f"{message} (is PostgreSQL up and the URL right? Retrying is safe: a submit under the same external_id is never made twice)"
        )
    state = e.sqlstate or ""
    if state.startswith("08") or state in ("57P01", "57P02", "57P03"):
        return DatabaseUnavailable(message)
    if state == "22023":
        field = message.split(":", 1)[0].removeprefix("invalid ").strip() if message.startswith("invalid ") else None
        return InvalidInput(message, field)
    if state == "42501" and message.startswith("permission denied for"):
        function = message.rsplit(" ", 1)[-1] if message.startswith("permission denied for function") else ""
        role = _ROLES.get(function) or "permitq_producer"
        # The login, when the connection says it (else a placeholder to fill in).
        login = getattr(info, "user", None) or "<your login>"
        return RoleMissing(
            f"{message}; this needs the role {role}: use a login that has it, or a DBA runs "
            f"GRANT {role.split(' ')[0]} TO {login}"
        )
    if state == "42501":
        return NotOwner(message)
    if state == "23505":
        return ExternalIdTaken(message)
    if state == "55000":
        if message.startswith("no lease yet"):
            return NoLeaseYet(message)
        return UnknownRequest(message) if message.startswith("no request named") else LeaseLost(message)
    if state in ("3F000", "42883"):
        return PermitqError(
            f"{message} (the permitq schema is missing or older than this client{_looked_in(info)}: run "
            "`permitq migrate` there; or, if permitq was migrated into another database, fix the URL)"
        )
    return PermitqError(message)


def _exceeds_capacity(name: str, d: dict[str, Any]) -> str:
    """As the Rust client and the CLI say it: where, the bound, and the commands that fix it."""
    count, capacity = d.get("count") or 0, d.get("capacity") or 0
    named = d.get("named")
    at = f"{named} takes {count} from its parent {name}, which" if named else f"{name}={count} but {name}"
    bound = f"allows {capacity} grants per {d['per']}" if d.get("per") else f"has capacity {capacity}"
    # An instance's capacity is set on its template (a change there reaches it).
    target = f"'{d['template']}'" if d.get("template") and not named else name
    if isinstance(d.get("adaptive"), dict):
        return _adaptive_exceeded(at, name, count, capacity, d["adaptive"])
    ask = f"ask for at most {capacity}, or " if capacity > 0 else ""
    return (
        f"{at} {bound}: it can never be granted; {ask}raise the capacity "
        f"(`permitq semaphore set {target} {count}`); then submit again under a new external_id"
    )


def _adaptive_exceeded(at: str, name: str, count: int, capacity: int, a: dict[str, Any]) -> str:
    """An adaptive semaphore's exceeds_capacity, as the Rust client and the CLI say it: the
    workers moved its capacity (or its ceiling is the bound), and what to ask for instead."""
    algorithm, floor, ceiling = a.get("algorithm"), a.get("floor"), a.get("ceiling")
    bounds = f"adaptive, {algorithm} from {floor} to {ceiling}"
    if isinstance(ceiling, int) and count > ceiling:
        return (
            f"{at} is {bounds} (its capacity is {capacity} now): it can never be granted; ask for "
            f"at most {ceiling}, or raise its ceiling (`permitq semaphore set {name} {capacity} "
            f"--adaptive {algorithm} --floor {floor} --ceiling {count}`); then submit again under a "
            "new external_id"
        )
    if isinstance(floor, int) and count <= floor:
        # Set below its floor by hand: the next cadence brings it back within its bounds.
        return (
            f"{at} has capacity {capacity} now, below its floor {floor} ({bounds}): it was set by hand, "
            "and the workers bring it back within its bounds at their next cadence; submit again under a "
            f"new external_id (`permitq semaphore show {name}` shows the capacity)"
        )
    moved = (
        f"has capacity {capacity} now: the workers backed it off from {a['from']} ({bounds}) on "
        "its holders' reports, and it may grow back"
        if a.get("from") is not None
        else f"has capacity {capacity} now ({bounds}: the workers move it)"
    )
    # A floor raised to the ceiling leaves it nothing to adapt: said.
    fixed = (
        f": with floor and ceiling equal it stays at {count}, no longer adapting"
        if count == ceiling
        else ""
    )
    return (
        f"{at} {moved}; a request is decided against the capacity it finds, so ask for at most "
        f"{floor} (its floor, which always fits), or raise the floor (`permitq semaphore set {name} "
        f"{count} --adaptive {algorithm} --floor {count} --ceiling {ceiling}`{fixed}); then submit "
        "again under a new external_id"
    )
