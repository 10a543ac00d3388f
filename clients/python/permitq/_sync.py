"""The synchronous client and its lease guard."""

from __future__ import annotations

import datetime as dt
import select
import threading
import time
import weakref
from typing import Any, Callable, Mapping, TypeVar

import psycopg

from . import _common as c
from ._errors import (
    AcquireTimeout,
    DatabaseUnavailable,
    LeaseLost,
    PermitqError,
    request_failed,
    translated,
)

T = TypeVar("T")


class Client:
    """A producer's handle on permitq: one connection (reopened when it breaks), safe to share
    between threads. `Client(url)`, or `with Client(url) as client:` to close it at the end."""

    def __init__(self, url: str, *, listen: bool = True, poll_interval: float = c.POLL_SECONDS) -> None:
        c.check_url(url)
        self._url = url
        # The leases this client handed out and not released: a `release(id)` of one of them
        # tells it, so that it says lost rather than go on as if it held the permits.
        self._leases: weakref.WeakValueDictionary[str, Lease] = weakref.WeakValueDictionary()
        # Through a pooler in transaction mode LISTEN does not work: `listen=False` waits by
        # reading the status every `poll_interval` (0.25 s) only.
        self._listen = listen
        self._poll_seconds = c.seconds(poll_interval, "poll_interval") or c.POLL_SECONDS
        self._conn: psycopg.Connection[Any] | None = None
        self._lock = threading.Lock()
        # LISTEN connections between acquires (one per acquire waiting at once): opening one
        # for every acquire cost more than the wait.
        self._listeners: list[psycopg.Connection[Any]] = []

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Closes the connections."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
            for listener in self._listeners:
                listener.close()
            self._listeners.clear()

    def _take_listener(self) -> psycopg.Connection[Any]:
        """A connection that LISTENs on the events: an idle one, else a new one."""
        with self._lock:
            while self._listeners:
                listener = self._listeners.pop()
                if not listener.closed and not listener.broken:
                    return listener
                listener.close()
        listener = self._connect("permitq-python-listen")
        try:
            listener.execute(f"LISTEN {c.EVENTS}")
        except psycopg.Error as e:
            listener.close()
            raise translated(e) from e
        return listener

    def _give_back_listener(self, listener: psycopg.Connection[Any]) -> None:
        """Keeps a sound listener for the next acquire (events that reach it meanwhile only
        make that acquire read its status once more)."""
        if listener.closed or listener.broken:
            return
        with self._lock:
            self._listeners.append(listener)
        # Nothing reads an idle listener: closed after a while, or its unread events would
        # hold back PostgreSQL's notification queue for everyone.
        timer = threading.Timer(c.IDLE_LISTENER_SECONDS, self._close_if_idle, (listener,))
        timer.daemon = True
        timer.start()

    def _close_if_idle(self, listener: psycopg.Connection[Any]) -> None:
        with self._lock:
            if listener not in self._listeners:
                return
            self._listeners.remove(listener)
        listener.close()

    def _connect(self, application_name: str = "permitq-python") -> psycopg.Connection[Any]:
        try:
            # No prepared statements (PgBouncer in transaction mode has none); a server that
            # vanishes is noticed in well under a minute.
            conn = psycopg.connect(self._url, autocommit=True, application_name=application_name, **c.KEEPALIVES)
            conn.prepare_threshold = None
            return conn
        except psycopg.Error as e:
            raise translated(e) from e

    def _run(self, work: Callable[[psycopg.Connection[Any]], T]) -> T:
        with self._lock:
            if self._conn is None or self._conn.closed or self._conn.broken:
                self._conn = self._connect()
            try:
                return work(self._conn)
            except psycopg.Error as e:
                raise translated(e, self._conn.info) from e

    def submit(
        self,
        external_id: str,
        permits: Mapping[str, int] | None = None,
        *,
        owner: str | None = None,
        ttl: float | dt.timedelta | None = None,
        wait: float | dt.timedelta | None = None,
        priority: int = 0,
        fairness_key: str | None = None,
        fairness_weight: int | None = None,
    ) -> c.Status:
        """Submits a request (idempotent by `external_id`: the same call again returns the same
        request; other parameters raise ExternalIdTaken). `ttl`: the lease, heartbeat within it;
        `wait`: how long it may wait (0: fail fast); durations in seconds or timedelta."""
        args = (external_id, c.permits_json(c.checked_request(external_id, permits)), owner, c.seconds(ttl, "ttl"), c.seconds(wait, "wait"), c.whole(priority, "priority", -100, 100), fairness_key, c.whole(fairness_weight, "fairness_weight", 1, 1000))
        row = self._run(lambda conn: conn.execute(c.SUBMIT, args).fetchone())
        assert row is not None
        return c.Status.from_row(row)

    def status(self, external_id: str) -> c.Status | None:
        """The request, or None for an unknown id (or another login's, for a producer)."""
        row = self._run(lambda conn: conn.execute(c.STATUS, (external_id,)).fetchone())
        return None if row is None else c.Status.from_row(row)

    def release(self, external_id: str, outcome: str | None = None, latency: float | dt.timedelta | None = None) -> str:
        """Gives the permits back: `released`, `already_released`, `cancelled` (it was still
        waiting), `not_acquired` (it failed) or `unknown`. With `outcome` (ok, overloaded,
        failed) and an optional `latency`, it reports how the use went to the adaptive
        semaphores it held."""
        query, args = c.release_args(external_id, outcome, latency)
        row = self._run(lambda conn: conn.execute(query, args).fetchone())
        assert row is not None
        lease = self._leases.pop(external_id, None)
        if lease is not None:
            lease._given_back(str(row[0]))
        return str(row[0])

    def heartbeat(self, external_id: str, extend: float | dt.timedelta | None = None) -> dt.datetime | None:
        """Extends the lease to now + `extend` (else its ttl); the new expiry (None: no lease).
        Raises LeaseLost when it is gone, or still waiting."""
        row = self._run(lambda conn: conn.execute(c.HEARTBEAT, (external_id, c.seconds(extend, "extend"))).fetchone())
        return None if row is None else row[0]

    def report(self, external_id: str, outcome: str, latency: float | dt.timedelta | None = None) -> bool:
        """Reports how the holder's use went so far (ok, overloaded or failed, and an optional
        `latency`), while it still holds, to the adaptive semaphores it holds. Whether it was
        kept: False when no request has the id, when it is not held, or when none of its
        semaphores is adaptive. Until a cadence applies it, a later report replaces it unless it
        says less (ok < failed < overloaded)."""
        args = c.report_args(external_id, outcome, latency)
        row = self._run(lambda conn: conn.execute(c.REPORT, args).fetchone())
        assert row is not None
        return bool(row[0])

    def _granting(self) -> tuple[Any, ...] | None:
        return self._run(lambda conn: conn.execute(c.GRANTING).fetchone())

    def _cancel_quietly(self, external_id: str) -> bool:
        """Cancels a request whose caller has gone; False when that failed (it is left to its
        `wait`)."""
        try:
            self.release(external_id)
            return True
        except Exception:  # noqa: BLE001 - the interruption is what the caller sees
            return False

    def explain(self, external_id: str) -> c.Explanation | None:
        """Why the request waits, per semaphore; or how it ended. None for an unknown id."""
        rows = self._run(lambda conn: conn.execute(c.EXPLAIN, (external_id,)).fetchall())
        return c.explanation(rows)

    def set_capacity(
        self,
        name: str,
        capacity: int,
        *,
        fair: bool | None = None,
        per: float | dt.timedelta | None = None,
        max_instances: int | None = None,
        parent: str | None = None,
        guarantee: int | None = None,
        adaptive: Mapping[str, Any] | bool | None = None,
    ) -> c.Semaphore:
        """Creates or changes a semaphore (admins). None keeps a setting. `adaptive`:
        {"algorithm": "aimd" or "gradient", "floor": N, "ceiling": N} lets the workers set the
        capacity from the holders' reports (`Lease.release(outcome=...)`); False fixes it again."""
        args = (
            name,
            c.whole(capacity, "capacity", 0, c.INT4_MAX),
            fair,
            c.seconds(per, "per"),
            c.whole(max_instances, "max_instances", 0, c.INT4_MAX),
            parent,
            c.whole(guarantee, "guarantee", 0, c.INT4_MAX),
        )
        query, args = c.set_capacity_args(args, adaptive)
        row = self._run(lambda conn: conn.execute(query, args).fetchone())
        assert row is not None
        return c.Semaphore(*row)

    def acquire(
        self,
        external_id: str,
        permits: Mapping[str, int] | None = None,
        *,
        timeout: float | dt.timedelta = 30.0,
        owner: str | None = None,
        ttl: float | dt.timedelta | None = None,
        wait: float | dt.timedelta | None = None,
        priority: int = 0,
        fairness_key: str | None = None,
        fairness_weight: int | None = None,
    ) -> "Lease":
        """Submits and waits for the grant, at most `timeout`: a Lease (use it in a `with`
        block). Waits on LISTEN, reading the status every 0.25 s as well. At the deadline the
        request is cancelled (nothing waits on) and AcquireTimeout raised; an error outcome
        raises its RequestFailed subclass."""
        permits = c.checked_request(external_id, permits)
        limit = c.acquire_limit(timeout)
        deadline = time.monotonic() + limit
        # Retried until the deadline, as the submit is: a database that is down when acquire
        # starts may be back before it.
        listener = _until_deadline(deadline, self._take_listener) if self._listen else None
        # Whether the submit answered: only then may a request be left waiting.
        submitted = False
        try:
            sent = time.monotonic()
            status = _until_deadline(
                deadline,
                lambda: self.submit(external_id, permits, owner=owner, ttl=ttl, wait=wait, priority=priority, fairness_key=fairness_key, fairness_weight=fairness_weight),
            )
            submitted = True
            c.check_not_ended_before(status)
            # Granted before this call (a retry after a dropped connection): its lease may be
            # older than `sent`, so the lease heartbeats before it is handed over.
            granted_before = status.state == "acquired"
            # The submit's answer says nothing of the standbys: an outcome it shows is confirmed.
            barrier = True
            warned = False
            waiting_since = time.monotonic()
            asked_granting = False
            while not status.settled:
                if not asked_granting and time.monotonic() - waiting_since >= c.SAY_NOTHING_GRANTING_AFTER:
                    asked_granting = True
                    c.warn_nothing_granting(external_id, _or_empty(lambda: c.nothing_granting(self._granting())))
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    granting = _or_empty(lambda: c.nothing_granting(self._granting()))
                    why = _or_empty(lambda: c.why_waiting(self.explain(external_id), granting))
                    outcome = self.release(external_id)
                    raise AcquireTimeout(
                        c.timeout_message(external_id, f"within {limit:g}s", why, granting, outcome),
                        external_id,
                    )
                listener = _wait_for_event(listener, min(self._poll_seconds, remaining))
                try:
                    status, barrier = self._status_and_barrier(external_id) or (status, barrier)
                except DatabaseUnavailable as e:
                    # Read again at the next tick, until the deadline; said once.
                    if not warned:
                        c.warn_retrying(e, deadline - time.monotonic())
                        warned = True
            return self._granted(status, sent, deadline, granted_before, barrier)
        except c.NOTHING_TO_CANCEL:
            raise  # cancelled already, ended, or another request's id: nothing to cancel
        except BaseException as e:
            # The caller is gone (Ctrl-C, a cancelled task) or the wait failed: so is the
            # request, or it would be granted to nobody and hold its permits.
            cancelled = self._cancel_quietly(external_id)
            if isinstance(e, KeyboardInterrupt):
                c.say_interrupted(external_id, cancelled)
            elif not cancelled and submitted and isinstance(e, DatabaseUnavailable):
                raise DatabaseUnavailable(f"{e}; {c.left_waiting(external_id)}") from e
            raise
        finally:
            if listener is not None:
                self._give_back_listener(listener)

    def _status_and_barrier(self, external_id: str) -> tuple[c.Status, bool] | None:
        """`status`, and whether an outcome read needs `_confirm_durable` here."""
        row = self._run(lambda conn: conn.execute(c.STATUS_AND_BARRIER, (external_id,)).fetchone())
        return None if row is None else (c.Status.from_row(row[:-1]), bool(row[-1]))

    def _granted(
        self, status: c.Status, sent: float, deadline: float, granted_before: bool, barrier: bool
    ) -> "Lease":
        if barrier:
            self._confirm_durable(status.external_id, deadline)
        if status.state == "acquired":
            # The lease's clock starts when the request was sent: after a long wait it would be
            # handed over already near its end, so it starts at the grant just read, and a
            # heartbeat, at once, confirms it from its own send.
            waited_long = c.waited_long(sent, status.ttl)
            lease = Lease(self, status, time.monotonic() if waited_long else sent)
            self._leases[status.external_id] = lease
            if granted_before or waited_long:
                lease._heartbeat_now()
            return lease
        if status.state == "error":
            raise request_failed(status.external_id, status.error_code or "", status.error_detail)
        raise PermitqError(
            f"request {status.external_id} is {status.state}: this external_id was granted and "
            "released before; submit under a new one"
        )

    def _confirm_durable(self, external_id: str, deadline: float) -> None:
        """What was read reached the synchronous standby (a failover cannot take it back), or
        DatabaseUnavailable at the deadline (at least 1 s): a primary that lost its standby
        waits for it forever, so the connection is abandoned to that wait."""
        with self._lock:
            if self._conn is None or self._conn.closed or self._conn.broken:
                self._conn = self._connect()
            conn = self._conn
        done = _bounded(
            lambda: conn.execute(c.CONFIRM_DURABLE), max(deadline - time.monotonic(), 1.0), "permitq-confirm-durable"
        )
        if not done:
            with self._lock:
                if self._conn is conn:
                    self._conn = None
            raise DatabaseUnavailable(c.unconfirmed_message(external_id))
        error = done[0]
        if isinstance(error, psycopg.Error):
            raise translated(error) from error
        if error is not None:
            raise error


def _bounded(call: Callable[[], object], seconds: float, name: str) -> list[BaseException | None]:
    """`call` in a thread of its own, waited for at most `seconds`: `[None]` if it returned,
    `[error]` if it raised, `[]` if it is still running (a server that stopped answering keeps
    it forever: it is abandoned to it, with its connection)."""
    outcome: list[BaseException | None] = []

    def attempt() -> None:
        try:
            call()
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            outcome.append(e)

    runner = threading.Thread(target=attempt, name=name, daemon=True)
    runner.start()
    runner.join(timeout=seconds)
    return outcome


def _or_empty(read: Callable[[], str]) -> str:
    """A part of the timeout's message, or nothing when the database cannot say."""
    try:
        return read()
    except PermitqError:
        return ""


def _wait_for_event(listener: psycopg.Connection[Any] | None, seconds: float) -> psycopg.Connection[Any] | None:
    """Waits up to `seconds` for an event on `listener`; the listener, or None once it broke
    (the wait goes on by reading the status: latency, never a failed acquire)."""
    if listener is None:
        time.sleep(seconds)
        return None
    try:
        readable, _, _ = select.select([listener.fileno()], [], [], seconds)
        if readable:
            listener.execute("SELECT 1")  # takes the notifications in
        return listener
    except (psycopg.Error, OSError, ValueError):
        listener.close()
        return None


def _until_deadline(deadline: float, call: Callable[[], T]) -> T:
    """`call`, again while the database is unavailable, until `deadline` (it is idempotent)."""
    pause = 0.05
    while True:
        try:
            return call()
        except DatabaseUnavailable as e:
            if time.monotonic() + pause >= deadline:
                raise
            if pause == 0.05:
                c.warn_retrying(e, deadline - time.monotonic())
            time.sleep(pause)
            pause = min(pause * 2, 1.0)


class Lease:
    """Permits held: heartbeats in the background (every third of its ttl), releases when the
    `with` block ends (also on an exception), and says it is *lost* before the lease can have run
    out on the server: its clock starts when the request or the last confirmed heartbeat was
    sent, never when the answer came.

    Check `lease.is_lost` (or call `lease.check()`, which raises LeaseLost) before each step of
    the work, or wait on `lease.lost` (a threading.Event). Write with `lease.fencing_token`."""

    def __init__(self, client: Client, status: c.Status, sent: float) -> None:
        self._client = client
        self.external_id = status.external_id
        self.status = status
        self.fencing_token: int = status.fencing_token or 0
        self.ttl = status.ttl
        self.lost = threading.Event()
        self.lost_reason: str | None = None
        self._stop = threading.Event()
        self._released: str | None = None
        self._valid_until = None if self.ttl is None else sent + self.ttl
        self._watchdog: threading.Timer | None = None
        self._thread: threading.Thread | None = None
        if self.ttl is not None:
            self._arm_watchdog()
            self._thread = threading.Thread(target=self._heartbeats, name=f"permitq-lease-{self.external_id}", daemon=True)
            self._thread.start()

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    @property
    def is_lost(self) -> bool:
        """Whether the lease is lost (or may be): stop acting on what the permits guarded."""
        if not self.lost.is_set() and self._valid_until is not None:
            if time.monotonic() >= self._valid_until - self._margin():
                self._lose("no heartbeat was confirmed in time: the lease may run out")
        return self.lost.is_set()

    def check(self) -> None:
        """Raises LeaseLost once the lease is lost."""
        if self.is_lost:
            raise LeaseLost(c.lost_message(self.external_id, self.lost_reason))

    def report(self, outcome: str, latency: float | dt.timedelta | None = None) -> bool:
        """Reports how the use went so far, while it holds (Client.report)."""
        return self._client.report(self.external_id, outcome, latency)

    def release(self, outcome: str | None = None, latency: float | dt.timedelta | None = None) -> str:
        """Stops heartbeating and gives the permits back (once): the release outcome. With
        `outcome` (and `latency`), reports how the use went (Client.release)."""
        self._stop.set()
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._thread is not None and self._thread is not threading.current_thread():
            # A heartbeat stuck on a server that stopped answering is left behind.
            self._thread.join(timeout=1.0)
        if self._released is None:
            self._client._leases.pop(self.external_id, None)
            self._released = self._client.release(self.external_id, outcome, latency)
        return self._released

    def _given_back(self, outcome: str) -> None:
        """Released through `client.release(id)`, not this lease: it holds nothing any more."""
        self._released = outcome
        self._stop.set()
        if self._watchdog is not None:
            self._watchdog.cancel()
        self._lose(f"released through client.release({self.external_id!r}) ({outcome}): the permits are given back")

    def _heartbeat_now(self) -> None:
        """For a grant made before this acquire (its lease may be older than the call): the
        clock starts at this heartbeat, or the lease is lost."""
        if self.ttl is None:
            return
        sent = time.monotonic()
        try:
            self._client.heartbeat(self.external_id)
        except PermitqError as e:
            self._lose(c.earlier_grant_unconfirmed(e))
            return
        self._valid_until = sent + self.ttl
        self._arm_watchdog()

    def _margin(self) -> float:
        return (self.ttl or 0.0) * c.SAFETY_FRACTION

    def _lose(self, reason: str) -> None:
        if not self.lost.is_set():
            self.lost_reason = reason
            self.lost.set()

    def _arm_watchdog(self) -> None:
        """Sets `lost` when the lease would be lost without another heartbeat, whatever the
        heartbeat thread is doing (a heartbeat may hang on a server that stopped answering)."""
        assert self._valid_until is not None
        if self._watchdog is not None:
            self._watchdog.cancel()
        delay = max(0.0, self._valid_until - self._margin() - time.monotonic())
        self._watchdog = threading.Timer(delay, lambda: self.is_lost)
        self._watchdog.daemon = True
        self._watchdog.start()

    def _heartbeats(self) -> None:
        """Heartbeats on a connection of its own (a stuck one is replaced), every third of the ttl."""
        assert self.ttl is not None
        every = self.ttl / 3
        pause = every
        conn: psycopg.Connection[Any] | None = None
        try:
            while not self._stop.wait(pause):
                if self.is_lost:
                    return
                sent = time.monotonic()
                if conn is None or conn.closed or conn.broken:
                    try:
                        conn = self._client._connect("permitq-python-lease")
                    except PermitqError:
                        pause = min(every, 0.5)  # retried soon; the watchdog decides when it is lost
                        continue
                # One attempt, bounded: a server that stopped answering keeps it forever, so the
                # connection is left to it and the next attempt opens another.
                outcome = _bounded(
                    lambda conn=conn: conn.execute(c.HEARTBEAT, (self.external_id, None)),
                    max(every / 2, 0.5),
                    f"permitq-heartbeat-{self.external_id}",
                )
                if self._stop.is_set():
                    return
                if not outcome:
                    conn = None  # stuck: abandoned to its attempt
                    pause = 0.0
                    continue
                error = outcome[0]
                if error is None:
                    self._valid_until = sent + self.ttl
                    self._arm_watchdog()
                    pause = every
                    continue
                if isinstance(error, psycopg.Error) and isinstance(translated(error), LeaseLost):
                    self._lose(str(translated(error)))
                    return
                conn.close()
                conn = None
                pause = min(every, 0.5)
        finally:
            if conn is not None:
                conn.close()
