"""The Python client against a real PostgreSQL with a real `permitq worker` running.

    DATABASE_URL=postgres://... PERMITQ_ADMIN_URL=... python3 -m unittest discover clients/python/tests

DATABASE_URL: a producer login (or any login that may submit); PERMITQ_ADMIN_URL: an admin
login, for set_capacity and revoke (defaults to DATABASE_URL); PERMITQ_OTHER_URL: another
producer login, for ownership; PERMITQ_SUPER_URL: a superuser login on the same machine, to stop
the lease's backends (each test is skipped only when its variable is not set, and the Rust test
that runs this file sets them all). Every test uses ids of its own.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import unittest
import uuid
from unittest import mock

import permitq

URL = os.environ["DATABASE_URL"]
ADMIN_URL = os.environ.get("PERMITQ_ADMIN_URL", URL)
OTHER_URL = os.environ.get("PERMITQ_OTHER_URL")
SUPER_URL = os.environ.get("PERMITQ_SUPER_URL")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def wait_for(condition, what: str, seconds: float = 15.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"not within {seconds}s: {what}")


class SyncClientTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        cls.admin = permitq.Client(ADMIN_URL)
        cls.sem = new_id("py")
        cls.admin.set_capacity(cls.sem, 2)
        cls.client = permitq.Client(URL)

    @classmethod
    def tearDownClass(cls) -> None:
        cls.client.close()
        cls.admin.close()

    def test_submit_is_idempotent_and_other_parameters_are_refused(self) -> None:
        rid = new_id("idem")
        first = self.client.submit(rid, {self.sem: 1}, ttl=30)
        again = self.client.submit(rid, {self.sem: 1}, ttl=30)
        self.assertEqual(first.id, again.id)
        with self.assertRaises(permitq.ExternalIdTaken) as caught:
            self.client.submit(rid, {self.sem: 2}, ttl=30)
        self.assertIn("different parameters", str(caught.exception))
        wait_for(lambda: self.client.status(rid).settled, "granted")
        self.assertEqual(self.client.release(rid), "released")
        self.assertIsNone(self.client.status(new_id("unknown")))

    def test_acquire_confirms_durability_only_where_a_standby_could_take_the_grant_back(self) -> None:
        from unittest import mock

        from permitq import _common

        confirmed: list[str] = []
        confirm = self.client._confirm_durable

        def counted(external_id: str, deadline: float) -> None:
            confirmed.append(external_id)
            confirm(external_id, deadline)

        with mock.patch.object(self.client, "_confirm_durable", counted):
            # This server names no synchronous standbys: no barrier, no round trip for it.
            self.client.acquire(new_id("nobarrier"), {self.sem: 1}, timeout=15).release()
            self.assertEqual(confirmed, [])
            # Where the status says a barrier is needed, the grant waits for it.
            needed = _common.STATUS_AND_BARRIER.replace(
                "current_setting('synchronous_standby_names') <> '' OR pg_is_in_recovery()", "true"
            )
            self.assertNotEqual(needed, _common.STATUS_AND_BARRIER)
            rid = new_id("barrier")
            with mock.patch.object(_common, "STATUS_AND_BARRIER", needed):
                self.client.acquire(rid, {self.sem: 1}, timeout=15).release()
            self.assertEqual(confirmed, [rid])

    def test_a_lease_granted_after_a_wait_longer_than_its_ttl_is_not_handed_over_lost(self) -> None:
        import threading

        holders = [self.client.acquire(new_id("hold"), {self.sem: 1}, ttl=30, timeout=15) for _ in range(2)]
        waiter = permitq.Client(URL)
        got: list[object] = []
        thread = threading.Thread(
            target=lambda: got.append(waiter.acquire(new_id("longwait"), {self.sem: 1}, ttl=3, timeout=20))
        )
        try:
            thread.start()
            # Longer than the lease's 3 s ttl: its clock, started at the submit, would have run out.
            time.sleep(4)
            holders[0].release()
            thread.join(20)
            lease = got[0]
            assert isinstance(lease, permitq.Lease), lease
            self.assertFalse(lease.is_lost, lease.lost_reason)
            lease.check()
            lease.release()
        finally:
            for h in holders:
                h.release()
            waiter.close()

    def test_a_lease_released_through_the_client_says_it_is_lost(self) -> None:
        rid = new_id("given-back")
        with self.client.acquire(rid, {self.sem: 1}, ttl=30, timeout=15) as lease:
            self.assertEqual(self.client.release(rid), "released")
            self.assertTrue(lease.is_lost)
            with self.assertRaises(permitq.LeaseLost) as caught:
                lease.check()
            self.assertIn(
                f"released through client.release({rid!r}) (released): the permits are given back",
                str(caught.exception),
            )
        self.assertEqual(lease.release(), "released", "the outcome, not a second release")

    def test_acquire_heartbeats_releases_on_exit_and_exposes_the_token(self) -> None:
        rid = new_id("lease")
        with self.client.acquire(rid, {self.sem: 1}, ttl=1.5, timeout=15) as lease:
            self.assertGreater(lease.fencing_token, 0)
            # Three ttls long: only the background heartbeats keep it.
            time.sleep(4.5)
            self.assertFalse(lease.is_lost, lease.lost_reason)
            self.assertEqual(self.client.status(rid).state, "acquired")
        status = self.client.status(rid)
        self.assertEqual((status.state, status.release_reason), ("released", "released"))

    def test_the_lease_is_released_on_an_exception_too(self) -> None:
        rid = new_id("boom")
        with self.assertRaises(RuntimeError):
            with self.client.acquire(rid, {self.sem: 1}, ttl=30, timeout=15):
                raise RuntimeError("work failed")
        self.assertEqual(self.client.status(rid).state, "released")

    def test_a_release_reports_to_an_adaptive_semaphore(self) -> None:
        sem = new_id("py-adaptive")
        self.admin.set_capacity(sem, 5, adaptive={"algorithm": "aimd", "floor": 1, "ceiling": 10})
        lease = self.client.acquire(new_id("adapt"), {sem: 1}, ttl=30, timeout=15)
        with self.assertRaises(permitq.InvalidInput) as caught:
            self.client.release(lease.external_id, outcome="great")
        self.assertEqual(caught.exception.field, "outcome")
        self.assertEqual(lease.release(outcome="overloaded", latency=0.05), "released")
        capacity = lambda: self.admin._run(
            lambda conn: conn.execute("SELECT capacity FROM permitq.semaphore WHERE name = %s", (sem,)).fetchone()[0]
        )
        wait_for(lambda: capacity() == 4, "the overload reported lowers the capacity")

    def test_a_holder_reports_while_it_holds(self) -> None:
        sem = new_id("py-report")
        self.admin.set_capacity(sem, 5, adaptive={"algorithm": "aimd", "floor": 1, "ceiling": 10})
        with self.client.acquire(new_id("hold"), {sem: 1}, ttl=30, timeout=15) as lease:
            with self.assertRaises(permitq.InvalidInput) as caught:
                lease.report("great")
            self.assertEqual(caught.exception.field, "outcome")
            self.assertTrue(lease.report("overloaded", latency=0.9))
            capacity = lambda: self.admin._run(
                lambda conn: conn.execute("SELECT capacity FROM permitq.semaphore WHERE name = %s", (sem,)).fetchone()[0]
            )
            # While it still holds: the report alone lowers the capacity.
            wait_for(lambda: capacity() == 4, "the overload reported while holding lowers the capacity")
            self.assertEqual(self.client.status(lease.external_id).state, "acquired")
        # Not held any more, or no such request: not kept.
        self.assertFalse(self.client.report(lease.external_id, "ok"))
        self.assertFalse(self.client.report(new_id("nobody"), "ok"))

    def test_a_revoked_lease_is_lost_and_check_raises(self) -> None:
        rid = new_id("revoked")
        with self.client.acquire(rid, {self.sem: 1}, ttl=1.5, timeout=15) as lease:
            self.admin._run(lambda conn: conn.execute("SELECT permitq.revoke(%s)", (rid,)))
            self.assertTrue(lease.lost.wait(5), "lost signalled")
            self.assertIn("lease lost", lease.lost_reason)
            with self.assertRaises(permitq.LeaseLost):
                lease.check()

    def test_the_lease_says_lost_before_it_can_run_out_when_heartbeats_stop(self) -> None:
        rid = new_id("cut")
        lease = self.client.acquire(rid, {self.sem: 1}, ttl=5, timeout=15)
        try:
            # Heartbeats no longer get through (the database is unreachable, as the client sees it).
            good = self.client._url
            self.client.close()
            self.client._url = "postgres://nobody@127.0.0.1:1/nothing"
            self.assertTrue(lease.lost.wait(6), "lost signalled")
            self.assertIn("no heartbeat was confirmed in time", lease.lost_reason)
            self.client._url = good
            # The server's lease still held when the client said it was lost.
            held = self.client._run(
                lambda conn: conn.execute(
                    "SELECT state = 'acquired' AND expires_at > now() FROM permitq.status(%s)", (rid,)
                ).fetchone()
            )
            self.assertEqual(held, (True,))
        finally:
            self.client._url = good
            lease.release()

    @unittest.skipUnless(SUPER_URL, "PERMITQ_SUPER_URL names a superuser login (to stop backends)")
    def test_a_stopped_database_is_signalled_as_lost_before_the_lease_runs_out(self) -> None:
        import signal

        import psycopg

        rid = new_id("stopped")
        user = self.client._run(lambda conn: conn.execute("SELECT current_user").fetchone())[0]
        with psycopg.connect(SUPER_URL, autocommit=True) as su:
            with self.client.acquire(rid, {self.sem: 1}, ttl=3, timeout=15) as lease:
                heartbeated = lambda: su.execute(  # noqa: E731
                    "SELECT heartbeat_at IS NOT NULL FROM permitq.permit_request WHERE external_id = %s", (rid,)
                ).fetchone()[0]
                wait_for(heartbeated, "a first heartbeat")
                # The lease's sessions stop answering, and it cannot open new ones.
                su.execute(f'ALTER ROLE "{user}" NOLOGIN')
                pids = [r[0] for r in su.execute(
                    "SELECT pid FROM pg_stat_activity WHERE application_name = 'permitq-python-lease'"
                ).fetchall()]
                self.assertTrue(pids)
                (expires,) = su.execute(
                    "SELECT expires_at FROM permitq.permit_request WHERE external_id = %s", (rid,)
                ).fetchone()
                for pid in pids:
                    os.kill(pid, signal.SIGSTOP)
                try:
                    self.assertTrue(lease.lost.wait(5), "lost signalled")
                    (lost_before_expiry,) = su.execute("SELECT now() < %s", (expires,)).fetchone()
                    self.assertIn("no heartbeat was confirmed in time", lease.lost_reason)
                    self.assertTrue(lost_before_expiry, "signalled before expires_at")
                finally:
                    for pid in pids:
                        os.kill(pid, signal.SIGCONT)
                    su.execute(f'ALTER ROLE "{user}" LOGIN')

    def test_fencing_tokens_increase_and_polling_alone_waits_too(self) -> None:
        tokens = []
        with permitq.Client(URL, listen=False) as polling:
            for _ in range(3):
                with polling.acquire(new_id("tok"), {self.sem: 1}, ttl=30, timeout=15) as lease:
                    tokens.append(lease.fencing_token)
        self.assertEqual(tokens, sorted(set(tokens)), tokens)

    def test_errors_are_types_with_their_detail(self) -> None:
        with self.assertRaises(permitq.ExceedsCapacity) as caught:
            self.client.acquire(new_id("huge"), {self.sem: 5}, timeout=15)
        self.assertEqual(caught.exception.error_detail["capacity"], 2)
        self.assertIn(
            f"{self.sem}=5 but {self.sem} has capacity 2: it can never be granted; ask for at most 2, "
            f"or raise the capacity (`permitq semaphore set {self.sem} 5`)",
            str(caught.exception),
        )
        with self.assertRaises(permitq.UnknownSemaphore) as caught:
            self.client.acquire(new_id("typo"), {self.sem + "x": 1}, timeout=15)
        self.assertIn(self.sem, caught.exception.error_detail.get("similar", []))
        # A template at its bound: the idle instance to delete is named.
        lab = new_id("lab")
        self.admin.set_capacity(lab + "-*", 1, max_instances=1)
        with self.client.acquire(new_id("inst"), {lab + "-1": 1}, timeout=15):
            pass
        with self.assertRaises(permitq.TooManyInstances) as caught:
            self.client.acquire(new_id("inst"), {lab + "-2": 1}, timeout=15)
        self.assertIn(
            f"{lab}-1 holds nothing: delete one (`permitq semaphore delete {lab}-1`)", str(caught.exception)
        )
        # A template bounded to none makes none: nothing to delete.
        self.admin.set_capacity(lab + "-none-*", 1, max_instances=0)
        with self.assertRaises(permitq.TooManyInstances) as caught:
            self.client.acquire(new_id("inst"), {lab + "-none-1": 1}, timeout=15)
        self.assertIn(f"template {lab}-none-* has max_instances 0: it makes no instance at all", str(caught.exception))
        self.assertNotIn("delete", str(caught.exception))
        with self.assertRaises(permitq.InvalidInput) as caught:
            self.client.submit(new_id("bad"), {self.sem: 1}, ttl=-1)
        self.assertEqual(caught.exception.field, "ttl")
        with self.assertRaises(permitq.InvalidInput) as caught:
            self.client.submit(new_id("none"), {})
        self.assertEqual(caught.exception.field, "permits")
        # The id left out: the permits were taken as the id, and it says so (nothing sent).
        for call in (self.client.acquire, self.client.submit):
            with self.assertRaises(permitq.InvalidInput) as caught:
                call({self.sem: 1})  # type: ignore[arg-type]
            self.assertEqual(caught.exception.field, "external_id")
            self.assertIn("the request's id, chosen by you, comes first, then the permits", str(caught.exception))
        # A duration is seconds or a timedelta; anything else is refused naming the field.
        with self.assertRaises(permitq.InvalidInput) as caught:
            self.client.submit(new_id("units"), {self.sem: 1}, ttl="30s")  # type: ignore[arg-type]
        self.assertEqual(caught.exception.field, "ttl")
        self.assertIn("give seconds (e.g. ttl=30) or a datetime.timedelta", str(caught.exception))
        never = new_id("never")
        with self.assertRaises(permitq.UnknownRequest) as caught:
            self.client.heartbeat(never)
        # Still a LeaseLost (a holder stops on it), worded as the mistyped id it most often is.
        self.assertIsInstance(caught.exception, permitq.LeaseLost)
        self.assertIn(f"no request named {never}: none was submitted under that external_id (check it)", str(caught.exception))
        self.assertEqual(type(caught.exception).__module__, "permitq", "tracebacks name the public module")

    def test_a_heartbeat_on_a_waiting_request_says_it_has_no_lease_yet(self) -> None:
        holders = [self.client.acquire(new_id("hold"), {self.sem: 1}, ttl=30, timeout=15) for _ in range(2)]
        try:
            waiting = new_id("waiting")
            self.client.submit(waiting, {self.sem: 1})
            with self.assertRaises(permitq.NoLeaseYet) as caught:
                self.client.heartbeat(waiting)
            self.assertIsInstance(caught.exception, permitq.LeaseLost)
            self.assertIn("still waiting to be granted", str(caught.exception))
            self.client.release(waiting)
        finally:
            for holder in holders:
                holder.release()

    def test_a_malformed_url_is_refused_at_once_and_a_refused_login_is_not_retried(self) -> None:
        for url, said in [
            ("localhost/app", 'missing "=" after "localhost/app"'),
            ("mysql://a@h/db", "mysql:// is not PostgreSQL's scheme"),
            ("postgres://me:p@ss@localhost/app", "must be percent-encoded in the URL (@ as %40"),
            ("postgres://a@h:port/db", "port 'port' is not a number"),
            ("", "is DATABASE_URL set but empty?"),
        ]:
            no_pg_env = {v: "" for v in ("PGHOST", "PGUSER", "PGDATABASE", "PGSERVICE")}
            with self.assertRaises(permitq.InvalidInput, msg=url) as caught, mock.patch.dict(os.environ, no_pg_env):
                permitq.Client(url)
            self.assertEqual(caught.exception.field, "database URL")
            self.assertIn(said, str(caught.exception))
            self.assertIn("expected postgres://user[:password]@host[:port]/database", str(caught.exception))
        from psycopg.conninfo import conninfo_to_dict, make_conninfo

        stranger_url = make_conninfo(**{**conninfo_to_dict(URL), "user": "no_such_login_here", "password": ""})
        with permitq.Client(stranger_url) as stranger:
            started = time.monotonic()
            with self.assertRaises(permitq.LoginRejected) as refused:
                stranger.acquire(new_id("stranger"), {self.sem: 1}, timeout=5)
            # libpq's failure once, though it tried the host more than once.
            said = str(refused.exception)
            self.assertEqual(said.count('role "no_such_login_here" does not exist'), 1, said)
            self.assertLess(time.monotonic() - started, 4, "not retried until the deadline: retrying cannot help")
        # A database that does not exist: create it or name another (not pg_hba.conf).
        nowhere_url = make_conninfo(**{**conninfo_to_dict(URL), "dbname": "no_such_database_here"})
        with permitq.Client(nowhere_url) as nowhere:
            with self.assertRaises(permitq.LoginRejected) as refused:
                nowhere.acquire(new_id("nowhere"), {self.sem: 1}, timeout=5)
            self.assertIn("create it (createdb", str(refused.exception))
            self.assertNotIn("pg_hba.conf", str(refused.exception))

    def test_a_deadline_cancels_the_request_so_nothing_waits_on(self) -> None:
        holders = [self.client.acquire(new_id("full"), {self.sem: 1}, ttl=30, timeout=15) for _ in range(2)]
        try:
            rid = new_id("late")
            started = time.monotonic()
            with self.assertRaises(permitq.AcquireTimeout) as caught:
                self.client.acquire(rid, {self.sem: 1}, timeout=1)
            self.assertLess(time.monotonic() - started, 5)
            self.assertEqual(caught.exception.external_id, rid)
            status = self.client.status(rid)
            self.assertEqual((status.state, status.error_code), ("error", "cancelled"))
            # It says what held it back, read before the cancel, and what became of it.
            self.assertIn(f"({self.sem}: ", str(caught.exception))
            # And whom it waited on.
            for lease in holders:
                self.assertIn(f"{lease.external_id} (1 for ", str(caught.exception))
            self.assertIn(", held by ", str(caught.exception))
            self.assertIn("; it was cancelled, so it no longer waits: acquire again", str(caught.exception))
            # Workers run: nothing says otherwise.
            self.assertNotIn("nothing is granting", str(caught.exception))
            # The same id again is that ended request, and says so.
            with self.assertRaises(permitq.PermitqError) as again:
                self.client.acquire(rid, {self.sem: 1}, timeout=1)
            self.assertIn("was submitted before and has ended", str(again.exception))
            explanation = self.client.explain(rid)
            self.assertIn("cancelled", explanation.outcome)
        finally:
            for lease in holders:
                lease.release()

    def test_acquires_one_after_another_share_one_listen_connection(self) -> None:
        with permitq.Client(URL) as client:
            with client.acquire(new_id("reuse"), {self.sem: 1}, timeout=15):
                pass
            first = list(client._listeners)
            self.assertEqual(len(first), 1)
            for _ in range(2):
                with client.acquire(new_id("reuse"), {self.sem: 1}, timeout=15):
                    pass
            self.assertEqual(client._listeners, first, "the same connection, not one per acquire")
            self.assertFalse(first[0].closed)
        self.assertTrue(first[0].closed, "close() closes it")

    def test_an_interrupted_acquire_cancels_its_request(self) -> None:
        """Ctrl-C while waiting: the request goes too, or it would be granted to nobody."""
        holders = [self.client.acquire(new_id("hold"), {self.sem: 1}, ttl=30, timeout=15) for _ in range(2)]
        rid = new_id("ctrlc")

        def interrupt(*_: object) -> None:
            raise KeyboardInterrupt

        previous = signal.signal(signal.SIGALRM, interrupt)
        try:
            signal.setitimer(signal.ITIMER_REAL, 1.0)
            with self.assertRaises(KeyboardInterrupt):
                self.client.acquire(rid, {self.sem: 1}, timeout=30)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            for lease in holders:
                lease.release()
        status = self.client.status(rid)
        self.assertEqual((status.state, status.error_code), ("error", "cancelled"))

    def test_a_waiting_acquire_is_woken_by_the_release(self) -> None:
        holders = [self.client.acquire(new_id("hold"), {self.sem: 1}, ttl=30, timeout=15) for _ in range(2)]
        rid = new_id("next")
        # Reading the status only every 60 s: only the event can wake it in time.
        waiter = permitq.Client(URL, poll_interval=60)
        try:
            import threading

            got: list[permitq.Lease] = []
            thread = threading.Thread(target=lambda: got.append(waiter.acquire(rid, {self.sem: 1}, timeout=30)))
            thread.start()
            wait_for(lambda: (e := self.client.explain(rid)) and e.semaphores and e.semaphores[0].position, "examined")
            explanation = self.client.explain(rid)
            self.assertEqual(explanation.semaphores[0].shortfall, 1)
            released = time.monotonic()
            holders[0].release()
            thread.join(20)
            self.assertEqual(len(got), 1)
            self.assertLess(time.monotonic() - released, 10, "woken by the event, not by a status read")
            self.assertEqual(got[0].status.state, "acquired")
            got[0].release()
        finally:
            for lease in holders:
                lease.release()
            waiter.close()

    @unittest.skipUnless(SUPER_URL, "PERMITQ_SUPER_URL names a superuser login")
    def test_a_listener_that_dies_mid_wait_costs_latency_not_the_acquire(self) -> None:
        holders = [self.client.acquire(new_id("hold"), {self.sem: 1}, ttl=30, timeout=15) for _ in range(2)]
        rid = new_id("orphan")
        waiter = permitq.Client(URL, poll_interval=0.2)
        try:
            import threading

            import psycopg

            got: list[object] = []

            def acquire() -> None:
                try:
                    got.append(waiter.acquire(rid, {self.sem: 1}, timeout=30))
                except Exception as e:  # noqa: BLE001 - asserted below
                    got.append(e)

            thread = threading.Thread(target=acquire)
            thread.start()
            wait_for(lambda: self.client.status(rid), "submitted")
            with psycopg.connect(SUPER_URL, autocommit=True) as su:
                killed = wait_for(
                    lambda: su.execute(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                        "WHERE application_name = 'permitq-python-listen' AND query ILIKE 'LISTEN%'"
                    ).fetchone()[0],
                    "the waiter's LISTEN connection terminated",
                )
            self.assertGreater(killed, 0)
            holders[0].release()
            thread.join(20)
            self.assertEqual(len(got), 1)
            self.assertIsInstance(got[0], permitq.Lease, f"the acquire went on by polling: {got[0]!r}")
            got[0].release()  # type: ignore[union-attr]
        finally:
            for lease in holders:
                lease.release()
            waiter.close()

    def test_acquiring_an_earlier_grant_again_heartbeats_before_handing_it_over(self) -> None:
        rid = new_id("again")
        first = self.client.acquire(rid, {self.sem: 1}, ttl=30, timeout=15)
        try:
            granted_until = self.client.status(rid).expires_at
            # A retry of the same acquire (after a dropped connection): the same grant, whose
            # lease clock must not start now.
            again = self.client.acquire(rid, {self.sem: 1}, ttl=30, timeout=15)
            self.assertEqual(again.fencing_token, first.fencing_token)
            self.assertFalse(again.is_lost)
            self.assertGreater(self.client.status(rid).expires_at, granted_until, "a heartbeat extended it")
        finally:
            first.release()

    def test_explain_says_what_a_fairness_key_did_to_the_place(self) -> None:
        import psycopg

        sem = new_id("keyed")
        self.admin.set_capacity(sem, 1)
        with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
            conn.execute("SELECT permitq.set_fairness_keys(%s, true)", (sem,))
        hold = self.client.acquire(new_id("hold"), {sem: 1}, ttl=30, timeout=15)
        try:
            rid = new_id("keyed")
            self.client.submit(rid, {sem: 1}, fairness_key="tenant-a")
            wait_for(lambda: (e := self.client.explain(rid)) and e.semaphores and e.semaphores[0].position, "examined")
            said = self.client.explain(rid).semaphores[0].fairness
            self.assertTrue(said and said.startswith("fairness key tenant-a, weight 1: placed at its arrival"), said)
            self.assertIsNone(self.client.explain(rid).semaphores[0].via)
            self.client.release(rid)
        finally:
            hold.release()

    def test_a_fairness_key_and_weight_travel_with_the_request(self) -> None:
        rid = new_id("keyed")
        status = self.client.submit(rid, {self.sem: 1}, fairness_key="tenant-a", fairness_weight=3)
        self.assertEqual((status.fairness_key, status.fairness_weight), ("tenant-a", 3))
        self.assertEqual(self.client.status(rid).fairness_key, "tenant-a")
        self.client.release(rid)
        for kwargs, field in [
            ({"fairness_key": "t", "fairness_weight": 0}, "fairness_weight"),
            ({"fairness_weight": 2}, "fairness_weight"),
            ({"fairness_key": ""}, "fairness_key"),
        ]:
            with self.assertRaises(permitq.InvalidInput) as caught:
                self.client.submit(new_id("keyed"), {self.sem: 1}, **kwargs)
            self.assertEqual(caught.exception.field, field, kwargs)

    def test_out_of_range_numbers_are_invalid_input_not_a_missing_function(self) -> None:
        for call, field in [
            (lambda: self.client.submit(new_id("p"), {self.sem: 1}, priority=2**40), "priority"),
            (lambda: self.client.submit(new_id("p"), {self.sem: 1}, priority=101), "priority"),
            (lambda: self.admin.set_capacity(new_id("cap"), 2**40), "capacity"),
        ]:
            with self.assertRaises(permitq.InvalidInput) as caught:
                call()
            self.assertEqual(caught.exception.field, field)

    @unittest.skipUnless(OTHER_URL, "PERMITQ_OTHER_URL names another producer login")
    def test_another_producers_request_is_not_ours(self) -> None:
        rid = new_id("mine")
        lease = self.client.acquire(rid, {self.sem: 1}, ttl=30, timeout=15)
        try:
            with permitq.Client(OTHER_URL) as other:
                self.assertIsNone(other.status(rid))
                with self.assertRaises(permitq.NotOwner):
                    other.release(rid)
        finally:
            lease.release()

    @unittest.skipUnless(SUPER_URL, "PERMITQ_SUPER_URL names a superuser login (to make a database)")
    def test_a_missing_schema_names_the_database_it_was_looked_for_in(self) -> None:
        import psycopg

        db = new_id("noschema").replace("-", "_")
        with psycopg.connect(SUPER_URL, autocommit=True) as su:
            su.execute(f"CREATE DATABASE {db}")
        try:
            url = psycopg.conninfo.make_conninfo(SUPER_URL, dbname=db)
            with permitq.Client(url) as elsewhere:
                with self.assertRaises(permitq.PermitqError) as caught:
                    elsewhere.status("x")
            self.assertIn(f"older than this client in database {db} at ", str(caught.exception))
            self.assertIn(
                "run `permitq migrate` there; or, if permitq was migrated into another database, fix the URL",
                str(caught.exception),
            )
        finally:
            with psycopg.connect(SUPER_URL, autocommit=True) as su:
                su.execute(f"DROP DATABASE {db}")

    @unittest.skipUnless(SUPER_URL, "PERMITQ_SUPER_URL names a superuser login (to make a login)")
    def test_a_login_without_a_permitq_role_is_told_which_role(self) -> None:
        import psycopg

        login = new_id("norole").replace("-", "_")
        with psycopg.connect(SUPER_URL, autocommit=True) as su:
            su.execute(f"CREATE ROLE {login} LOGIN PASSWORD 'pw'")
        try:
            url = psycopg.conninfo.make_conninfo(SUPER_URL, user=login, password="pw")
            with permitq.Client(url) as plain:
                with self.assertRaises(permitq.RoleMissing) as caught:
                    plain.submit(new_id("p"), {self.sem: 1})
            self.assertIsInstance(caught.exception, permitq.NotOwner)
            self.assertIn(
                "permission denied for schema permitq; this needs the role permitq_producer: use a login "
                f"that has it, or a DBA runs GRANT permitq_producer TO {login}",
                str(caught.exception),
            )
        finally:
            with psycopg.connect(SUPER_URL, autocommit=True) as su:
                su.execute(f"DROP ROLE {login}")

    def test_a_database_gone_at_the_deadline_leaves_the_request_said_to_wait(self) -> None:
        """The outage as the client meets it (its reads and its cancel fail) after a real submit:
        it says so once while it waits, and at the deadline that the request may still wait."""
        from unittest import mock

        rid = new_id("left")
        holders = [self.client.acquire(new_id("hold"), {self.sem: 1}, ttl=30, timeout=15) for _ in range(2)]
        waiter = permitq.Client(URL)
        down = permitq.DatabaseUnavailable("connection refused (simulated)")
        try:
            with (
                mock.patch.object(waiter, "_status_and_barrier", side_effect=down),
                mock.patch.object(waiter, "release", side_effect=down),
                self.assertLogs("permitq", level="WARNING") as said,
                self.assertRaises(permitq.DatabaseUnavailable) as caught,
            ):
                waiter.acquire(rid, {self.sem: 1}, timeout=1)
            self.assertIn("retrying until the acquire's deadline", "\n".join(said.output))
            self.assertIn(
                f"request {rid} was submitted and could not be cancelled, so it may still be waiting: "
                f"once the database answers, cancel it (client.release('{rid}') or `permitq release {rid}`)",
                str(caught.exception),
            )
            self.assertEqual(self.client.status(rid).state, "new", "what the error said")
        finally:
            self.client.release(rid)
            for lease in holders:
                lease.release()
            waiter.close()

    def test_an_unreachable_database_is_retryable_and_says_so(self) -> None:
        with permitq.Client("postgres://nobody@127.0.0.1:1/nothing") as down:
            with self.assertRaises(permitq.DatabaseUnavailable):
                down.status("x")
            # acquire retries (its LISTEN connection, its idempotent submit) until its deadline.
            started = time.monotonic()
            # It says so when it starts retrying: a database that is down must not read as a
            # busy semaphore.
            with self.assertLogs("permitq", level="WARNING") as said:
                with self.assertRaises(permitq.DatabaseUnavailable) as caught:
                    down.acquire(new_id("down"), {"x": 1}, timeout=1.5)
            # Never reached, nothing was submitted: it does not say a request may be waiting.
            self.assertNotIn("was submitted", str(caught.exception))
            self.assertGreater(time.monotonic() - started, 0.5, "it retried, not gave up at once")
            self.assertIn("retrying until the acquire's deadline", "\n".join(said.output))


class OutcomeWordsTest(unittest.TestCase):
    def test_a_revoke_while_waiting_names_who_revoked_it(self) -> None:
        from permitq._errors import request_failed

        failed = request_failed("r-1", "cancelled", {"revoked_by": "ops"})
        self.assertIn("revoked by ops (`permitq revoke`) while it was still waiting", str(failed))

    def test_a_timeout_or_cancel_that_took_its_keys_turn_says_the_turn_stays_taken(self) -> None:
        from permitq._errors import request_failed

        said = ("; its turn on gpu stays taken for its fairness key until the line passes it, so the key's next "
                "request there is placed behind it")
        timed_out = request_failed("r-1", "timeout", {"semaphore": "gpu", "count": 1, "capacity": 1, "free": 0,
                                                     "turn_kept_on": ["gpu"]})
        self.assertIn(said, str(timed_out))
        revoked = request_failed("r-2", "cancelled", {"revoked_by": "ops", "turn_kept_on": ["gpu"]})
        self.assertIn("while it was still waiting; submit again under a new external_id if it is still wanted" + said,
                      str(revoked))
        plain = request_failed("r-3", "timeout", {"semaphore": "gpu", "count": 1, "capacity": 1, "free": 0})
        self.assertNotIn("turn", str(plain))

    def test_a_template_named_itself_is_told_to_name_an_instance(self) -> None:
        from permitq._errors import request_failed

        failed = request_failed("r-5", "unknown_semaphore", {"semaphore": "lab:*", "similar": []})
        self.assertIn("lab:* is a template, which is never granted itself: name an instance of it (lab:NAME", str(failed))
        self.assertNotIn("create it", str(failed))

    def test_an_unknown_semaphore_is_said_as_the_cli_says_it(self) -> None:
        from permitq._errors import request_failed

        typo = request_failed("r-6", "unknown_semaphore", {"semaphore": "GPU", "similar": ["gpu"]})
        self.assertIn("no semaphore named GPU, and no template matches it; did you mean gpu?", str(typo))
        none = request_failed("r-7", "unknown_semaphore", {"semaphore": "zzz", "similar": []})
        self.assertIn("no semaphore named zzz, and no template matches it; create it with "
                      "`permitq semaphore set zzz CAPACITY` (or a template NAME* that matches it)", str(none))
        parent = request_failed("r-8", "unknown_semaphore", {"semaphore": "pool", "named": "gpu-a", "similar": []})
        self.assertIn("gpu-a's parent pool does not exist", str(parent))

    def test_exceeds_capacity_names_the_parent_window_or_template_and_the_command(self) -> None:
        from permitq._errors import request_failed

        parent = request_failed("r-2", "exceeds_capacity", {"semaphore": "gpus", "named": "gpu-a", "count": 5, "capacity": 4})
        self.assertIn("gpu-a takes 5 from its parent gpus, which has capacity 4: it can never be granted; "
                      "ask for at most 4, or raise the capacity (`permitq semaphore set gpus 5`)", str(parent))
        window = request_failed("r-3", "exceeds_capacity", {"semaphore": "api", "count": 9, "capacity": 0, "per": "1s"})
        self.assertIn("api=9 but api allows 0 grants per 1s: it can never be granted; raise the capacity", str(window))
        instance = request_failed("r-4", "exceeds_capacity", {"semaphore": "lab:a", "template": "lab:*", "count": 3, "capacity": 2})
        self.assertIn("(`permitq semaphore set 'lab:*' 3`); then submit again under a new external_id", str(instance))
        adaptive = {"algorithm": "aimd", "floor": 2, "ceiling": 10}
        backed_off = request_failed("r-5", "exceeds_capacity", {"semaphore": "calls", "count": 8, "capacity": 7, "adaptive": {**adaptive, "from": 8}})
        self.assertIn("calls=8 but calls has capacity 7 now: the workers backed it off from 8 (adaptive, aimd from 2 "
                      "to 10) on its holders' reports, and it may grow back; a request is decided against the "
                      "capacity it finds, so ask for at most 2 (its floor, which always fits)", str(backed_off))
        at_ceiling = request_failed("r-8", "exceeds_capacity", {"semaphore": "calls", "count": 10, "capacity": 7, "adaptive": adaptive})
        self.assertIn("--floor 10 --ceiling 10`: with floor and ceiling equal it stays at 10, no longer adapting)",
                      str(at_ceiling))
        above = request_failed("r-6", "exceeds_capacity", {"semaphore": "calls", "count": 12, "capacity": 7, "adaptive": adaptive})
        self.assertIn("calls=12 but calls is adaptive, aimd from 2 to 10 (its capacity is 7 now): it can never be "
                      "granted; ask for at most 10, or raise its ceiling (`permitq semaphore set calls 7 --adaptive "
                      "aimd --floor 2 --ceiling 12`)", str(above))
        below = request_failed("r-7", "exceeds_capacity", {"semaphore": "calls", "count": 2, "capacity": 1, "adaptive": adaptive})
        self.assertIn("calls=2 but calls has capacity 1 now, below its floor 2 (adaptive, aimd from 2 to 10): it was "
                      "set by hand, and the workers bring it back within its bounds at their next cadence", str(below))


class NothingGrantingTest(unittest.TestCase):
    def test_the_timeout_says_when_no_worker_runs(self) -> None:
        """GRANTING's row as the message reads it (the contract test runs the statement)."""
        from permitq import _common

        self.assertEqual(_common.nothing_granting((2, 0.4, "app")), "")
        said = _common.nothing_granting((0, 42.2, "app"))
        self.assertIn("nothing is granting: no worker seen for 42s; start one with `permitq worker`", said)
        self.assertIn("or it works on another database than app", said)
        self.assertIn("no worker seen in the last hour", _common.nothing_granting((0, None, "app")))
        message = _common.timeout_message("r-1", "within 5s", " (gpu: full)", said, "cancelled")
        self.assertTrue(message.startswith("request r-1 was not granted within 5s (gpu: full); nothing is granting"), message)
        self.assertNotIn("cancelled (cancelled)", message)
        self.assertIn("granted at that very moment", _common.timeout_message("r", "", "", "", "released"))
        # While nothing is granting, a row not examined yet (which speaks of a running worker)
        # is left out; the others stay.
        def wait(semaphore: str, reason: str) -> _common.SemaphoreWait:
            return _common.SemaphoreWait(semaphore, 1, 1, 0, 1, None, None, reason, [], None, None, None)

        unexamined = _common.Explanation("r", "new", None, [
            wait("gpu", "not examined by a worker yet: a running worker does within a second or so"),
            wait("disk", "waits for 1 more permit to be released (first in line)"),
        ])
        self.assertEqual(_common.why_waiting(unexamined, said), " (disk: waits for 1 more permit to be released (first in line))")
        self.assertIn("gpu: not examined", _common.why_waiting(unexamined))


class ContractTest(unittest.TestCase):
    def test_every_statement_the_client_sends_exists_with_its_signature(self) -> None:
        """Each statement is prepared by the server: a function, argument or column the schema
        no longer has fails here, in CI, not at a user's."""
        from permitq import _common

        statements = {name: value for name, value in vars(_common).items() if name.isupper() and isinstance(value, str) and value.startswith("SELECT")}
        self.assertGreaterEqual(len(statements), 7, statements)
        with permitq.Client(ADMIN_URL) as client:
            for name, sql in statements.items():
                numbered = sql
                n = 0
                while "%s" in numbered:
                    n += 1
                    numbered = numbered.replace("%s", f"${n}", 1)
                client._run(lambda conn: conn.execute(f"PREPARE contract_{name.lower()} AS {numbered}"))
                client._run(lambda conn: conn.execute(f"DEALLOCATE contract_{name.lower()}"))


class AsyncClientTest(unittest.IsolatedAsyncioTestCase):
    async def test_acquire_heartbeat_release_and_errors(self) -> None:
        admin = await permitq.AsyncClient.connect(ADMIN_URL)
        sem = new_id("apy")
        await admin.set_capacity(sem, 1)
        async with await permitq.AsyncClient.connect(URL) as client:
            rid = new_id("alease")
            async with await client.acquire(rid, {sem: 1}, ttl=1.5, timeout=15) as lease:
                self.assertGreater(lease.fencing_token, 0)
                await asyncio.sleep(4)
                self.assertFalse(lease.is_lost, lease.lost_reason)
                # Full: a second acquire times out and is cancelled.
                late = new_id("alate")
                with self.assertRaises(permitq.AcquireTimeout):
                    await client.acquire(late, {sem: 1}, timeout=1)
                self.assertEqual((await client.status(late)).error_code, "cancelled")
                # A cancelled task's acquire cancels its request.
                gone = new_id("agone")
                task = asyncio.create_task(client.acquire(gone, {sem: 1}, timeout=30))
                for _ in range(300):
                    if await client.status(gone) is not None:
                        break
                    await asyncio.sleep(0.02)
                task.cancel()
                with self.assertRaises(asyncio.CancelledError):
                    await task
                self.assertEqual((await client.status(gone)).error_code, "cancelled")
            self.assertEqual((await client.status(rid)).state, "released")
            with self.assertRaises(permitq.ExceedsCapacity):
                await client.acquire(new_id("ahuge"), {sem: 2}, timeout=15)
        # Waiting by polling only (as through a pooler in transaction mode).
        async with await permitq.AsyncClient.connect(URL, listen=False) as polling:
            async with await polling.acquire(new_id("apoll"), {sem: 1}, ttl=30, timeout=15) as lease:
                self.assertGreater(lease.fencing_token, 0)
        await admin.close()

    async def test_a_holder_reports_while_it_holds(self) -> None:
        admin = await permitq.AsyncClient.connect(ADMIN_URL)
        sem = new_id("apy-report")
        await admin.set_capacity(sem, 5, adaptive={"algorithm": "aimd", "floor": 1, "ceiling": 10})
        async with await permitq.AsyncClient.connect(URL) as client:
            async with await client.acquire(new_id("ahold"), {sem: 1}, ttl=30, timeout=15) as lease:
                with self.assertRaises(permitq.InvalidInput):
                    await lease.report("great")
                self.assertTrue(await lease.report("overloaded", latency=0.9))
                for _ in range(500):
                    row = await admin._one("SELECT capacity FROM permitq.semaphore WHERE name = %s", (sem,))
                    if row[0] == 4:
                        break
                    await asyncio.sleep(0.02)
                self.assertEqual(row[0], 4, "the overload reported while holding lowers the capacity")
            self.assertFalse(await client.report(lease.external_id, "ok"))
        await admin.close()

    async def test_woken_by_the_event_released_on_an_exception_and_kept_from_others(self) -> None:
        admin = await permitq.AsyncClient.connect(ADMIN_URL)
        sem = new_id("aev")
        await admin.set_capacity(sem, 1)
        # Reading the status only every 60 s: only the event can wake the waiter in time.
        async with await permitq.AsyncClient.connect(URL, poll_interval=60) as client:
            holder = await client.acquire(new_id("ahold"), {sem: 1}, ttl=30, timeout=15)
            rid = new_id("anext")
            waiting = asyncio.create_task(client.acquire(rid, {sem: 1}, ttl=30, timeout=30))
            for _ in range(500):
                e = await client.explain(rid)
                if e and e.semaphores and e.semaphores[0].position:
                    break
                await asyncio.sleep(0.02)
            released = time.monotonic()
            await holder.release()
            lease = await asyncio.wait_for(waiting, 20)
            self.assertLess(time.monotonic() - released, 10, "woken by the event, not by a status read")
            # Released when the block ends with an exception.
            with self.assertRaises(RuntimeError):
                async with lease:
                    raise RuntimeError("work failed")
            self.assertEqual((await client.status(rid)).state, "released")
            if OTHER_URL:
                mine = new_id("amine")
                async with await client.acquire(mine, {sem: 1}, ttl=30, timeout=15):
                    async with await permitq.AsyncClient.connect(OTHER_URL) as other:
                        self.assertIsNone(await other.status(mine))
                        with self.assertRaises(permitq.NotOwner):
                            await other.release(mine)
        await admin.close()


if __name__ == "__main__":
    unittest.main()
