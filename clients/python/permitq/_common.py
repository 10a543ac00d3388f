"""What the synchronous and the asyncio clients share: the statements and the row type."""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Mapping

import psycopg

from ._errors import AcquireTimeout, ExternalIdTaken, InvalidInput, PermitqError, RequestFailed

#: The channel the workers announce outcomes on (payloads: JSON arrays of request ids).
EVENTS = "permitq_events"
#: How often a waiting acquire reads the status again when no notification came (a pooler or a
#: failover may lose one: it costs latency, never a hang).
POLL_SECONDS = 0.25
#: How long before the lease could have run out on the server a Lease says it is lost.
SAFETY_FRACTION = 0.2
# How long a LISTEN connection may wait idle for the next acquire before it is closed.
IDLE_LISTENER_SECONDS = 10.0
#: libpq's keepalive settings, so that a server that vanishes without closing the socket is
#: noticed in well under a minute.
KEEPALIVES = {"keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5, "keepalives_count": 3, "tcp_user_timeout": 30000}

_COLUMNS = (
    "id, external_id, permits, owner, state, error_code, error_detail, release_reason, "
    "fencing_token, acquired_at, expires_at, released_at, "
    "extract(epoch FROM ttl)::float8, extract(epoch FROM wait)::float8, priority, fairness_key, "
    "fairness_weight"
)
SUBMIT = (
    f"SELECT {_COLUMNS} FROM permitq.submit(%s, %s::jsonb, owner => %s, "
    "ttl => make_interval(secs => %s), wait => make_interval(secs => %s), priority => %s, "
    "fairness_key => %s, fairness_weight => %s)"
)
STATUS = f"SELECT {_COLUMNS} FROM permitq.status(%s)"
#: STATUS, and whether `permitq.confirm_durable` would do anything in this session (synchronous
#: standbys are named, or this is a standby, where it refuses): an acquire reads it beside the
#: outcome, so that a server without synchronous standbys costs no extra round trip.
STATUS_AND_BARRIER = (
    f"SELECT {_COLUMNS}, current_setting('synchronous_standby_names') <> '' OR pg_is_in_recovery() "
    "FROM permitq.status(%s)"
)
RELEASE = "SELECT permitq.release(%s)"
def adaptive_json(adaptive: Mapping[str, Any] | bool | None) -> str | None:
    """set_capacity's `adaptive`: {"algorithm", "floor", "ceiling"} makes it adaptive, False fixes
    it again, None keeps it."""
    if adaptive is None:
        return None
    if adaptive is False:
        return "false"
    if not isinstance(adaptive, Mapping):
        raise InvalidInput(
            'adaptive: give {"algorithm": "aimd" or "gradient", "floor": N, "ceiling": N}, or False', "adaptive"
        )
    return json.dumps(dict(adaptive))


def lost_message(external_id: str, reason: str | None) -> str:
    """What Lease.check raises: `lease of ID lost: REASON` (a reason that says "lease lost" already
    is not said twice)."""
    reason = reason or ""
    if reason.startswith("lease lost: "):
        reason = reason[len("lease lost: "):]
    return f"lease of {external_id} lost: {reason}"


#: A release with a report of how the use went (adaptive capacity).
RELEASE_REPORTING = "SELECT permitq.release(%s, %s, make_interval(secs => %s))"
OUTCOMES = ("ok", "overloaded", "failed")


#: A holder's report while it holds (beside a heartbeat).
REPORT = "SELECT permitq.report(%s, %s, make_interval(secs => %s))"


def check_outcome(outcome: str) -> None:
    """Refuses an outcome that is not ok, overloaded or failed, before anything is sent."""
    if outcome not in OUTCOMES:
        raise InvalidInput(f"outcome: must be ok, overloaded (a 429, a timeout, a pool exhausted) or failed, got {outcome!r}", "outcome")


def report_args(external_id: str, outcome: str, latency: float | dt.timedelta | None) -> tuple[Any, ...]:
    """The arguments of a report: while holding (REPORT), or with the release (RELEASE_REPORTING)."""
    check_outcome(outcome)
    return (external_id, outcome, seconds(latency, "latency"))


def release_args(external_id: str, outcome: str | None, latency: float | dt.timedelta | None) -> tuple[str, tuple[Any, ...]]:
    """The statement and arguments of a release, with a report when `outcome` is given."""
    if outcome is None:
        if latency is not None:
            raise InvalidInput("latency: a latency is reported with an outcome: give outcome= too", "latency")
        return RELEASE, (external_id,)
    return RELEASE_REPORTING, report_args(external_id, outcome, latency)
HEARTBEAT = "SELECT permitq.heartbeat(%s, make_interval(secs => %s))"
EXPLAIN = (
    "SELECT request, state, outcome, semaphore, needs, capacity, free, shortfall, position, "
    "permits_ahead, reason, holders, extract(epoch FROM estimated_wait)::float8, via, kept, "
    "fairness FROM permitq.explain(%s)"
)
SET_CAPACITY = (
    "SELECT name, capacity, used, fair, extract(epoch FROM per)::float8, parent, guarantee, "
    "max_instances FROM permitq.set_capacity(%s, %s, fair => %s, per => make_interval(secs => %s), "
    "max_instances => %s, parent => %s, guarantee => %s)"
)
#: With `adaptive`: only when it is given, so that a change without it also works on a schema
#: from before adaptive capacity (a rolling upgrade).
SET_CAPACITY_ADAPTIVE = SET_CAPACITY[:-1] + ", adaptive => %s::jsonb)"


def set_capacity_args(args: tuple[Any, ...], adaptive: Mapping[str, Any] | bool | None) -> tuple[str, tuple[Any, ...]]:
    """The set_capacity statement and its arguments, `adaptive` among them only when given."""
    if adaptive is None:
        return SET_CAPACITY, args
    return SET_CAPACITY_ADAPTIVE, (*args, adaptive_json(adaptive))
CONFIRM_DURABLE = "SELECT permitq.confirm_durable()"
GRANTING = (
    "SELECT live_workers, extract(epoch FROM clock_timestamp() - last_seen)::float8,"
    " current_database()::text FROM permitq.granting()"
)


_URL_FORM = (
    "expected postgres://user[:password]@host[:port]/database (e.g. postgres://app@localhost:5432/app, "
    "or postgres:///app for the local socket), or key=value pairs (host=localhost dbname=app user=app)"
)


def check_url(url: str) -> None:
    """Refuses, before connecting, a URL libpq would refuse or misread: one that does not parse,
    another scheme, a password with an unencoded @ (libpq takes the rest as the host), a port
    that is not a number. An empty one is libpq's defaults (PGHOST, PGUSER, ...), as in libpq, when
    one of them is set; else refused (an environment variable set but empty)."""
    from psycopg.conninfo import conninfo_to_dict

    def invalid(what: str) -> InvalidInput:
        return InvalidInput(f"invalid database URL: {what}: {_URL_FORM}", "database URL")

    if not isinstance(url, str):
        raise invalid(f"{url!r} is not a string (os.environ.get('DATABASE_URL') is None when it is unset)")
    if not url.strip() and not any(os.environ.get(v) for v in ("PGHOST", "PGUSER", "PGDATABASE", "PGSERVICE")):
        # libpq would try its defaults (a local socket as this OS user): almost always an
        # environment variable set but empty.
        raise invalid("it is empty, and no PGHOST, PGUSER or PGDATABASE is set (is DATABASE_URL set but empty?)")

    scheme, sep, rest = url.partition("://")
    if sep and scheme.lower() not in ("postgres", "postgresql"):
        raise invalid(f"{scheme}:// is not PostgreSQL's scheme: use postgres://")
    if sep and rest.split("/", 1)[0].split("?", 1)[0].count("@") > 1:
        raise invalid(
            "a password (or user name) with an @, :, / or # in it must be percent-encoded in the URL "
            "(@ as %40, : as %3A, / as %2F, # as %23)"
        )
    try:
        parts = conninfo_to_dict(url)
    except psycopg.ProgrammingError as e:
        raise invalid(" ".join(str(e).split())) from None
    port = str(parts.get("port", "0"))
    if not all(p.strip().isdigit() for p in port.split(",")):
        raise invalid(f"port {port!r} is not a number")


def seconds(value: float | dt.timedelta | None, field: str) -> float | None:
    """A duration in seconds, from seconds (int or float) or a timedelta; `field` names it in
    the InvalidInput raised for anything else."""
    if value is None:
        return None
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise InvalidInput(
        f"{field}: {value!r} is not a duration: give seconds (e.g. {field}=30) or a datetime.timedelta",
        field,
    )


INT4_MAX = 2**31 - 1


def whole(value: Any, field: str, low: int, high: int) -> Any:
    """`value` if it is a whole number within [low, high] (None passes), else InvalidInput naming
    `field`: out of range, PostgreSQL would take it as a bigint and answer "no such function"."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidInput(f"invalid {field}: must be a whole number from {low} to {high}, got {value!r}", field)
    return value


def checked_request(external_id: object, permits: Mapping[str, int] | None) -> Mapping[str, int]:
    """`permits`, once the call named an id first and then permits; else InvalidInput saying
    which (a dict alone, `acquire({"gpu": 1})`, is an id left out, not permits)."""
    if isinstance(external_id, Mapping) and permits is None:
        raise InvalidInput(
            f"the request's id, chosen by you, comes first, then the permits: "
            f"acquire('job-1', {dict(external_id)!r}) ({dict(external_id)!r} was taken as the id)",
            "external_id",
        )
    if not isinstance(external_id, str):
        raise InvalidInput(f"external_id must be a string, not {type(external_id).__name__}", "external_id")
    if permits is None:
        raise InvalidInput("name what to acquire after the id: acquire('job-1', {'gpu': 1})", "permits")
    return permits


def permits_json(permits: Mapping[str, int]) -> str:
    """The request's permits as the SQL API takes them."""
    if not isinstance(permits, Mapping):
        raise InvalidInput(f"permits: {permits!r} is not a mapping: give {{'gpu': 1}} (semaphore: count)", "permits")
    if not permits:
        raise InvalidInput("permits: name at least one semaphore and its count, e.g. {'gpu': 1}", "permits")
    for name, count in permits.items():
        whole(count, f"count of {name}", 1, INT4_MAX)
    return json.dumps(dict(permits))


@dataclass(frozen=True)
class Status:
    """A request as stored: where it is in its life, how it ended, its lease and token."""

    id: int
    external_id: str
    permits: dict[str, int]
    owner: str | None
    state: str
    error_code: str | None
    error_detail: dict[str, Any] | None
    release_reason: str | None
    fencing_token: int | None
    acquired_at: dt.datetime | None
    expires_at: dt.datetime | None
    released_at: dt.datetime | None
    ttl: float | None
    wait: float | None
    priority: int
    fairness_key: str | None
    fairness_weight: int | None

    @property
    def settled(self) -> bool:
        """It left `new`: acquired, released or error."""
        return self.state != "new"

    @classmethod
    def from_row(cls, row: tuple[Any, ...]) -> "Status":
        return cls(*row)


@dataclass(frozen=True)
class SemaphoreWait:
    """One row of `explain`: what the request needs on one semaphore and what holds it back."""

    semaphore: str | None
    needs: int | None
    capacity: int | None
    free: int | None
    shortfall: int | None
    position: int | None
    permits_ahead: int | None
    reason: str | None
    holders: list[dict[str, Any]]
    estimated_wait: float | None
    via: str | None
    kept: int | None
    # On a semaphore served by fairness key: what its key did to its place, in sentences (its
    # key and weight, how far back its key's turns placed it, behind which of its key's
    # requests); None elsewhere.
    fairness: str | None = None


@dataclass(frozen=True)
class Explanation:
    """Why a request waits (`semaphores`), or how it ended (`outcome`)."""

    external_id: str
    state: str
    outcome: str | None
    semaphores: list[SemaphoreWait]


def explanation(rows: list[tuple[Any, ...]]) -> Explanation | None:
    if not rows:
        return None
    first = rows[0]
    waits = [SemaphoreWait(*row[3:]) for row in rows if row[3] is not None]
    return Explanation(first[0], first[1], first[2], waits)


@dataclass(frozen=True)
class Semaphore:
    """A semaphore as `set_capacity` left it."""

    name: str
    capacity: int
    used: int
    fair: bool
    per: float | None
    parent: str | None
    guarantee: int
    max_instances: int | None


# The start of `explain`'s reason for a request no worker has examined yet: it speaks of a
# running worker, which "nothing is granting" contradicts.
NOT_EXAMINED = "not examined by a worker yet: a running worker does"


def why_waiting(explanation: Explanation | None, nothing_granting: str = "") -> str:
    """What held the request back, from `explain` just before it is cancelled: ` (gpu: ...)`.
    While nothing is granting, a row not examined yet says nothing more than that does."""
    if explanation is None:
        return ""
    reasons = [
        f"{w.semaphore}: {w.reason}{held_by(w.holders)}"
        for w in explanation.semaphores
        if w.reason and not (nothing_granting and NOT_EXAMINED in w.reason)
    ]
    return f" ({'; '.join(reasons)})" if reasons else ""


def held_by(holders: list[dict[str, Any]]) -> str:
    """`, held by a (2 for 7.5s), b (1 for 3.0s)`: whom a waiting request waits on (at most 3
    named; `explain` lists at most 10, soonest to end first, and a producer login sees its own)."""
    if not holders:
        return ""
    named = [f"{h['external_id']} ({h['count']} for {h['held_for_s']:.1f}s)" for h in holders[:3]]
    more = f" and {len(holders) - 3} more" if len(holders) > 3 else ""
    return f", held by {', '.join(named)}{more}"


def nothing_granting(row: tuple[Any, ...] | None) -> str:
    """From GRANTING's row: `; nothing is granting: no worker seen for 42s; ...` when no worker
    runs, else empty."""
    if row is None or row[0] > 0:
        return ""
    since = "in the last hour" if row[1] is None else f"for {row[1]:.0f}s"
    return (
        f"; nothing is granting: no worker seen {since}; start one with `permitq worker` "
        f"(if you started one, it has exited, or it works on another database than {row[2]}: "
        "its log says why, unless it was killed, and its `worker started` line names its database)"
    )


def timeout_message(external_id: str, within: str, why: str, granting: str, outcome: str) -> str:
    """AcquireTimeout's message: what held the request back, whether anything grants, and what
    became of it (release's answer at the deadline)."""
    ended = {
        "cancelled": "it was cancelled, so it no longer waits",
        "released": "it was granted at that very moment and released at once",
    }.get(outcome, f"releasing it answered {outcome}")
    return (
        f"request {external_id} was not granted {within}{why}{granting}; {ended}: acquire again "
        "under a new external_id"
    )


# What `acquire` raises without cancelling its request: its own timeout cancelled it already, a
# failed request has ended, and ExternalIdTaken is another request's id.
NOTHING_TO_CANCEL = (AcquireTimeout, RequestFailed, ExternalIdTaken)


def acquire_limit(timeout: float | dt.timedelta) -> float:
    """`acquire`'s timeout in seconds; InvalidInput unless positive (`wait=0` is fail-fast)."""
    limit = seconds(timeout, "timeout") or 0.0
    if limit <= 0:
        raise InvalidInput(
            f"invalid timeout: must be positive (seconds to wait for the grant), got {timeout!r}; "
            "to fail at once when there is no room, give wait=0",
            "timeout",
        )
    return limit


def earlier_grant_unconfirmed(error: Exception) -> str:
    """Why a lease acquired again (granted before the call) is lost at once."""
    return f"the lease of a grant made before this acquire could not be confirmed: {error}"


def unconfirmed_message(external_id: str) -> str:
    """`acquire` could not confirm the outcome durable in time (it cancels the request)."""
    return (
        f"the outcome of request {external_id} did not reach the synchronous standby in time: this primary "
        "may have lost its standby in a failover; the request was cancelled (or released): ask again"
    )


def check_not_ended_before(status: Status) -> None:
    """A submit returns an ended request only when the external_id was used before."""
    if status.state in ("error", "released"):
        how = status.error_code or status.release_reason or status.state
        raise PermitqError(
            f"request {status.external_id} was submitted before and has ended ({status.state} {how}); "
            "this is that request: acquire under a new external_id"
        )


def waited_long(sent: float, ttl: float | None) -> bool:
    """Whether a grant came so long after its request was sent (a third of its ttl) that the
    lease, whose clock starts at the send, must heartbeat before it is handed over."""
    return ttl is not None and time.monotonic() - sent > ttl / 3


def left_waiting(external_id: str) -> str:
    """What an acquire that gave up while the database did not answer says of its request."""
    return (
        f"request {external_id} was submitted and could not be cancelled, so it may still be "
        f"waiting: once the database answers, cancel it (client.release({external_id!r}) or "
        f"`permitq release {external_id}`), or it may be granted with nobody to use it"
    )


def say_interrupted(external_id: str, cancelled: bool) -> None:
    """Said when Ctrl-C (or a cancelled task) ends an acquire: what became of its request."""
    logging.getLogger("permitq").warning(
        "acquire interrupted: %s",
        f"request {external_id} cancelled, nothing waits on" if cancelled else left_waiting(external_id),
    )


SAY_NOTHING_GRANTING_AFTER = 3.0
"""Seconds an acquire waits before it asks, once, whether any worker runs."""


def warn_nothing_granting(external_id: str, granting: str) -> None:
    """Said once when an acquire has waited a while and no worker runs (`granting`, as
    nothing_granting returns it): without it the caller sees nothing until the deadline."""
    if granting:
        logging.getLogger("permitq").warning("permitq: %s waits, and %s", external_id, granting.removeprefix("; "))


def warn_retrying(error: Exception, seconds_left: float) -> None:
    """Said once when an acquire starts retrying a database that does not answer: without it the
    caller sees nothing until the deadline, and a database that is down reads as a busy
    semaphore. Logged on the `permitq` logger (printed to stderr when logging is not set up)."""
    logging.getLogger("permitq").warning(
        "permitq: the database did not answer (%s); retrying until the acquire's deadline, %.0fs from now",
        error,
        seconds_left,
    )
