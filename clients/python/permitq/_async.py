"""The asyncio client and its lease guard: the synchronous ones' semantics, awaited."""

from __future__ import annotations

import asyncio
import datetime as dt
import time
import weakref
from typing import Any, Awaitable, Callable, Mapping, TypeVar

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


class AsyncClient:
    """`await AsyncClient.connect(url)`, or `async with await AsyncClient.connect(url) as client`.
    One connection (reopened when it breaks); calls on it take turns."""

    def __init__(self, url: str, *, listen: bool = True, poll_interval: float = c.POLL_SECONDS) -> None:
        c.check_url(url)
        self._url = url
        # As Client._leases.
        self._leases: weakref.WeakValueDictionary[str, AsyncLease] = weakref.WeakValueDictionary()
        self._listen = listen
        self._poll_seconds = c.seconds(poll_interval, "poll_interval") or c.POLL_SECONDS
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._lock = asyncio.Lock()
        # LISTEN connections between acquires (as Client's), each closed after a while idle.
        self._listeners: list[psycopg.AsyncConnection[Any]] = []
        self._idle_closers: set[asyncio.Task[None]] = set()

    @classmethod
    async def connect(cls, url: str, *, listen: bool = True, poll_interval: float = c.POLL_SECONDS) -> "AsyncClient":
        """A client, connected (so that a wrong URL is told at once). `listen=False` waits by
        reading the status only (through a pooler in transaction mode)."""
        client = cls(url, listen=listen, poll_interval=poll_interval)
        await client._run(lambda conn: conn.execute("SELECT 1"))
        return client

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Closes the connections."""
        async with self._lock:
            if self._conn is not None:
                await self._conn.close()
                self._conn = None
            for listener in self._listeners:
                await listener.close()
            self._listeners.clear()
            for closer in list(self._idle_closers):
                closer.cancel()

    async def _take_listener(self) -> psycopg.AsyncConnection[Any]:
        """A connection that LISTENs on the events: an idle one, else a new one."""
        while self._listeners:
            listener = self._listeners.pop()
            if not listener.closed and not listener.broken:
                return listener
            await listener.close()
        listener = await self._connect("permitq-python-listen")
        try:
            await listener.execute(f"LISTEN {c.EVENTS}")
        except psycopg.Error as e:
            await listener.close()
            raise translated(e) from e
        return listener

    async def _connect(self, application_name: str = "permitq-python") -> psycopg.AsyncConnection[Any]:
        try:
            conn = await psycopg.AsyncConnection.connect(
                self._url, autocommit=True, application_name=application_name, **c.KEEPALIVES
            )
            conn.prepare_threshold = None  # PgBouncer in transaction mode has no prepared statements
            return conn
        except psycopg.Error as e:
            raise translated(e) from e

    async def _run(self, work: Callable[[psycopg.AsyncConnection[Any]], Awaitable[T]]) -> T:
        async with self._lock:
            if self._conn is None or self._conn.closed or self._conn.broken:
                self._conn = await self._connect()
            try:
                return await work(self._conn)
            except psycopg.Error as e:
                raise translated(e, self._conn.info) from e

    async def _one(self, sql: str, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        async def work(conn: psycopg.AsyncConnection[Any]) -> tuple[Any, ...] | None:
            return await (await conn.execute(sql, args)).fetchone()

        return await self._run(work)

    async def submit(
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
        """As Client.submit."""
        row = await self._one(c.SUBMIT, (external_id, c.permits_json(c.checked_request(external_id, permits)), owner, c.seconds(ttl, "ttl"), c.seconds(wait, "wait"), c.whole(priority, "priority", -100, 100), fairness_key, c.whole(fairness_weight, "fairness_weight", 1, 1000)))
        assert row is not None
        return c.Status.from_row(row)

    async def status(self, external_id: str) -> c.Status | None:
        """As Client.status."""
        row = await self._one(c.STATUS, (external_id,))
        return None if row is None else c.Status.from_row(row)

    async def _status_and_barrier(self, external_id: str) -> tuple[c.Status, bool] | None:
        """As Client._status_and_barrier."""
        row = await self._one(c.STATUS_AND_BARRIER, (external_id,))
        return None if row is None else (c.Status.from_row(row[:-1]), bool(row[-1]))

    async def release(self, external_id: str, outcome: str | None = None, latency: float | dt.timedelta | None = None) -> str:
        """As Client.release."""
        query, args = c.release_args(external_id, outcome, latency)
        row = await self._one(query, args)
        assert row is not None
        lease = self._leases.pop(external_id, None)
        if lease is not None:
            lease._given_back(str(row[0]))
        return str(row[0])

    async def heartbeat(self, external_id: str, extend: float | dt.timedelta | None = None) -> dt.datetime | None:
        """As Client.heartbeat."""
        row = await self._one(c.HEARTBEAT, (external_id, c.seconds(extend, "extend")))
        return None if row is None else row[0]

    async def report(self, external_id: str, outcome: str, latency: float | dt.timedelta | None = None) -> bool:
        """As Client.report."""
        row = await self._one(c.REPORT, c.report_args(external_id, outcome, latency))
        assert row is not None
        return bool(row[0])

    async def _granting(self) -> tuple[Any, ...] | None:
        return await self._one(c.GRANTING, ())

    async def _cancel_quietly(self, external_id: str) -> bool:
        """As Client._cancel_quietly."""
        try:
            await self.release(external_id)
            return True
        except Exception:  # noqa: BLE001 - the interruption is what the caller sees
            return False

    async def explain(self, external_id: str) -> c.Explanation | None:
        """As Client.explain."""

        async def work(conn: psycopg.AsyncConnection[Any]) -> list[tuple[Any, ...]]:
            return await (await conn.execute(c.EXPLAIN, (external_id,))).fetchall()

        return c.explanation(await self._run(work))

    async def set_capacity(
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
        """As Client.set_capacity."""
        query, args = c.set_capacity_args(
            (
                name,
                c.whole(capacity, "capacity", 0, c.INT4_MAX),
                fair,
                c.seconds(per, "per"),
                c.whole(max_instances, "max_instances", 0, c.INT4_MAX),
                parent,
                c.whole(guarantee, "guarantee", 0, c.INT4_MAX),
            ),
            adaptive,
        )
        row = await self._one(query, args)
        assert row is not None
        return c.Semaphore(*row)

    async def acquire(
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
    ) -> "AsyncLease":
        """As Client.acquire: an AsyncLease (`async with`)."""
        permits = c.checked_request(external_id, permits)
        limit = c.acquire_limit(timeout)
        deadline = time.monotonic() + limit
        woken = asyncio.Event()
        listener: psycopg.AsyncConnection[Any] | None = None
        listening: asyncio.Task[None] | None = None

        async def listen(on: psycopg.AsyncConnection[Any]) -> None:
            try:
                async for _ in on.notifies():
                    woken.set()
            except psycopg.Error:
                pass  # closed: the status is read every poll_interval anyway

        # Whether the submit answered: only then may a request be left waiting.
        submitted = False
        try:
            if self._listen:
                # Retried until the deadline, as the submit is.
                listener = await _until_deadline(deadline, self._take_listener)
                listening = asyncio.create_task(listen(listener))
            sent = time.monotonic()
            status = await _until_deadline(
                deadline,
                lambda: self.submit(external_id, permits, owner=owner, ttl=ttl, wait=wait, priority=priority, fairness_key=fairness_key, fairness_weight=fairness_weight),
            )
            submitted = True
            c.check_not_ended_before(status)
            # Granted before this call (a retry): its lease may be older than `sent`.
            granted_before = status.state == "acquired"
            # The submit's answer says nothing of the standbys: an outcome it shows is confirmed.
            barrier = True
            warned = False
            waiting_since = time.monotonic()
            asked_granting = False
            while not status.settled:
                if not asked_granting and time.monotonic() - waiting_since >= c.SAY_NOTHING_GRANTING_AFTER:
                    asked_granting = True
                    c.warn_nothing_granting(external_id, await _or_empty(self._granting, c.nothing_granting))
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    granting = await _or_empty(self._granting, c.nothing_granting)
                    why = await _or_empty(
                        lambda: self.explain(external_id), lambda e: c.why_waiting(e, granting)
                    )
                    outcome = await self.release(external_id)
                    raise AcquireTimeout(
                        c.timeout_message(external_id, f"within {limit:g}s", why, granting, outcome),
                        external_id,
                    )
                try:
                    await asyncio.wait_for(woken.wait(), min(self._poll_seconds, remaining))
                except asyncio.TimeoutError:
                    pass
                _raise_if_cancelled()
                woken.clear()
                try:
                    status, barrier = await self._status_and_barrier(external_id) or (status, barrier)
                except DatabaseUnavailable as e:
                    # Read again at the next tick, until the deadline; said once.
                    if not warned:
                        c.warn_retrying(e, deadline - time.monotonic())
                        warned = True
                _raise_if_cancelled()
            if barrier:
                await self._confirm_durable(external_id, deadline)
            _raise_if_cancelled()
        except c.NOTHING_TO_CANCEL:
            raise  # cancelled already, ended, or another request's id: nothing to cancel
        except BaseException as e:
            # The caller is gone (Ctrl-C, a cancelled task) or the wait failed: so is the
            # request, or it would be granted to nobody and hold its permits. A cancellation
            # that reached a query ends it with an error: still a cancel.
            cancelled = await self._cancel_quietly(external_id)
            if isinstance(e, PermitqError) and _cancelling():
                raise asyncio.CancelledError from None
            if isinstance(e, KeyboardInterrupt):
                c.say_interrupted(external_id, cancelled)
            elif not cancelled and submitted and isinstance(e, DatabaseUnavailable):
                raise DatabaseUnavailable(f"{e}; {c.left_waiting(external_id)}") from e
            raise
        finally:
            if listening is not None:
                listening.cancel()
                try:
                    await listening
                except asyncio.CancelledError:
                    pass
            if listener is not None:
                await self._give_back_listener(listener)
        if status.state == "acquired":
            # As Client's: after a long wait, the clock starts at the grant, confirmed at once.
            waited_long = c.waited_long(sent, status.ttl)
            lease = AsyncLease(self, status, time.monotonic() if waited_long else sent)
            self._leases[status.external_id] = lease
            if granted_before or waited_long:
                await lease._heartbeat_now()
            return lease
        if status.state == "error":
            raise request_failed(status.external_id, status.error_code or "", status.error_detail)
        raise PermitqError(
            f"request {status.external_id} is {status.state}: this external_id was granted and "
            "released before; submit under a new one"
        )

    async def _confirm_durable(self, external_id: str, deadline: float) -> None:
        """What was read reached the synchronous standby, or DatabaseUnavailable at the deadline
        (at least 1 s): a primary that lost its standby waits for it forever."""
        try:
            await asyncio.wait_for(
                self._run(lambda conn: conn.execute(c.CONFIRM_DURABLE)), max(deadline - time.monotonic(), 1.0)
            )
        except asyncio.TimeoutError:
            stuck, self._conn = self._conn, None
            if stuck is not None:
                await stuck.close()
            raise DatabaseUnavailable(c.unconfirmed_message(external_id)) from None

    async def _give_back_listener(self, listener: psycopg.AsyncConnection[Any]) -> None:
        """Kept for the next acquire (as Client's), and closed if none takes it in a while."""
        if listener.closed or listener.broken:
            await listener.close()
            return
        self._listeners.append(listener)

        async def close_if_idle() -> None:
            await asyncio.sleep(c.IDLE_LISTENER_SECONDS)
            if listener in self._listeners:
                self._listeners.remove(listener)
                await listener.close()

        self._idle_closers.add(task := asyncio.create_task(close_if_idle()))
        task.add_done_callback(self._idle_closers.discard)


async def _or_empty(read: Callable[[], Awaitable[Any]], said: Callable[[Any], str]) -> str:
    """A part of the timeout's message, or nothing when the database cannot say."""
    try:
        return said(await read())
    except PermitqError:
        return ""


def _cancelling() -> bool:
    """Whether this task was asked to stop (whatever an await did with the CancelledError)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _raise_if_cancelled() -> None:
    """Raises CancelledError when this task was asked to stop and an await swallowed it (Python
    3.11's `wait_for` does when what it waits for completes at the same moment)."""
    if _cancelling():
        raise asyncio.CancelledError


async def _until_deadline(deadline: float, call: Callable[[], Awaitable[T]]) -> T:
    pause = 0.05
    while True:
        try:
            return await call()
        except DatabaseUnavailable as e:
            if time.monotonic() + pause >= deadline:
                raise
            if pause == 0.05:
                c.warn_retrying(e, deadline - time.monotonic())
            await asyncio.sleep(pause)
            pause = min(pause * 2, 1.0)


class AsyncLease:
    """As Lease, for asyncio: heartbeats in a task, releases at the end of `async with`;
    `lease.lost` is an asyncio.Event, `lease.is_lost` and `lease.check()` as Lease's."""

    def __init__(self, client: AsyncClient, status: c.Status, sent: float) -> None:
        self._client = client
        self.external_id = status.external_id
        self.status = status
        self.fencing_token: int = status.fencing_token or 0
        self.ttl = status.ttl
        self.lost = asyncio.Event()
        self.lost_reason: str | None = None
        self._valid_until = None if self.ttl is None else sent + self.ttl
        self._released: str | None = None
        self._watchdog: asyncio.TimerHandle | None = None
        self._task = None
        if self.ttl is not None:
            self._arm_watchdog()
            self._task = asyncio.create_task(self._heartbeats())

    async def __aenter__(self) -> "AsyncLease":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.release()

    @property
    def is_lost(self) -> bool:
        """Whether the lease is lost (or may be)."""
        if not self.lost.is_set() and self._valid_until is not None:
            if time.monotonic() >= self._valid_until - (self.ttl or 0.0) * c.SAFETY_FRACTION:
                self._lose("no heartbeat was confirmed in time: the lease may run out")
        return self.lost.is_set()

    def check(self) -> None:
        """Raises LeaseLost once the lease is lost."""
        if self.is_lost:
            raise LeaseLost(c.lost_message(self.external_id, self.lost_reason))

    async def report(self, outcome: str, latency: float | dt.timedelta | None = None) -> bool:
        """Reports how the use went so far, while it holds (Client.report)."""
        return await self._client.report(self.external_id, outcome, latency)

    async def release(self, outcome: str | None = None, latency: float | dt.timedelta | None = None) -> str:
        """Stops heartbeating and gives the permits back (once); with `outcome`, reports."""
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        if self._released is None:
            self._client._leases.pop(self.external_id, None)
            self._released = await self._client.release(self.external_id, outcome, latency)
        return self._released

    def _given_back(self, outcome: str) -> None:
        """As Lease._given_back."""
        self._released = outcome
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._task is not None:
            self._task.cancel()
        self._lose(f"released through client.release({self.external_id!r}) ({outcome}): the permits are given back")

    async def _heartbeat_now(self) -> None:
        """As Lease._heartbeat_now: for a grant made before this acquire."""
        if self.ttl is None:
            return
        sent = time.monotonic()
        try:
            await self._client.heartbeat(self.external_id)
        except PermitqError as e:
            self._lose(c.earlier_grant_unconfirmed(e))
            return
        self._valid_until = sent + self.ttl
        self._arm_watchdog()

    def _lose(self, reason: str) -> None:
        if not self.lost.is_set():
            self.lost_reason = reason
            self.lost.set()

    def _arm_watchdog(self) -> None:
        """Sets `lost` when the lease would be lost without another heartbeat, whatever the
        heartbeat task is waiting for."""
        assert self._valid_until is not None and self.ttl is not None
        if self._watchdog is not None:
            self._watchdog.cancel()
        delay = max(0.0, self._valid_until - self.ttl * c.SAFETY_FRACTION - time.monotonic())
        self._watchdog = asyncio.get_running_loop().call_later(delay, lambda: self.is_lost)

    async def _heartbeats(self) -> None:
        """Heartbeats on a connection of its own, every third of the ttl; an attempt that does
        not answer in time leaves its connection behind and the next one opens another."""
        assert self.ttl is not None
        every = self.ttl / 3
        pause = every
        conn: psycopg.AsyncConnection[Any] | None = None
        try:
            while True:
                await asyncio.sleep(pause)
                # release() cancels this task; Python 3.11's wait_for below may swallow that
                # cancellation (when the heartbeat answers at the same moment), and the loop
                # would then heartbeat forever while release() waits for it.
                _raise_if_cancelled()
                if self.is_lost:
                    return
                sent = time.monotonic()
                try:
                    if conn is None or conn.closed or conn.broken:
                        conn = await self._client._connect("permitq-python-lease")
                    await asyncio.wait_for(conn.execute(c.HEARTBEAT, (self.external_id, None)), max(every / 2, 0.5))
                    self._valid_until = sent + self.ttl
                    self._arm_watchdog()
                    pause = every
                except asyncio.TimeoutError:
                    conn = None  # stuck: abandoned
                    pause = 0.0
                except psycopg.Error as e:
                    error = translated(e)
                    if isinstance(error, LeaseLost):
                        self._lose(str(error))
                        return
                    conn = None
                    pause = min(every, 0.5)
                except PermitqError:
                    conn = None
                    pause = min(every, 0.5)
        finally:
            if conn is not None and not conn.closed:
                try:
                    await asyncio.wait_for(conn.close(), 0.5)
                except (asyncio.TimeoutError, psycopg.Error):
                    pass
