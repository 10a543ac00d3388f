"""permitq from Python, through the SQL API only (psycopg 3).

Submits a request for one GPU and one licence, waits for the outcome on the `permitq_events`
channel (re-reading `permitq.status` every second, so a missed notification only costs time),
heartbeats while "working", then releases.

    DATABASE_URL=postgres://app@db/app python3 examples/python/permitq_example.py

Needs Python 3 with psycopg 3 (Debian: python3-psycopg; pip: psycopg[binary]), a running worker
(`permitq worker`), and the semaphores `gpu` and `licence`. Create them with `permitq semaphore
set gpu 4` and `permitq semaphore set licence 2`, or set PERMITQ_EXAMPLE_SETUP=1 and the script
creates them itself (the login then needs the permitq_admin role). Each run uses a new request id.
Exits 0 when the request was granted and released; otherwise 1 with one line on stderr.
"""

import json
import os
import select
import sys
import time
import uuid

import psycopg


def wait_settled(conn, external_id, timeout):
    """The request's row once it leaves `new`, or None when `timeout` seconds pass.

    Wakes when the connection's socket has a notification (each `permitq_events` payload is a
    JSON array of request ids: the outcome itself is read with `status`), and re-reads the status at least every second anyway, so a missed
    notification only costs time. Works with every psycopg 3 (no `notifies(timeout=)` needed).
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = conn.execute(
            "SELECT state, error_code, fencing_token FROM permitq.status(%s)", (external_id,)
        ).fetchone()
        if row is None:
            raise SystemExit(f"unknown request {external_id}")
        if row[0] != "new":
            return row
        select.select([conn.fileno()], [], [], min(1.0, max(0.0, deadline - time.monotonic())))
    return None


def main():
    url = os.environ.get("DATABASE_URL")
    if not url:
        raise SystemExit("permitq_example: set DATABASE_URL")
    external_id = f"py-{uuid.uuid4().hex[:8]}"
    with psycopg.connect(url, autocommit=True) as conn:
        if os.environ.get("PERMITQ_EXAMPLE_SETUP") == "1":
            conn.execute("SELECT permitq.set_capacity('gpu', 4)")
            conn.execute("SELECT permitq.set_capacity('licence', 2)")
        conn.add_notify_handler(lambda n: None)  # delivered while the status is re-read
        conn.execute("LISTEN permitq_events")
        conn.execute(
            "SELECT permitq.submit(%s, %s::jsonb, owner => %s, ttl => '30 seconds', wait => '1 minute')",
            (external_id, json.dumps({"gpu": 1, "licence": 1}), "python-example"),
        )
        print(f"submitted {external_id}")
        row = wait_settled(conn, external_id, timeout=30)
        if row is None:
            raise SystemExit(f"permitq_example: {external_id} not granted in 30 s (is a worker running?)")
        if row[0] != "acquired":
            hint = ""
            if row[1] == "unknown_semaphore":
                hint = " (create them: permitq semaphore set gpu 4; permitq semaphore set licence 2)"
            raise SystemExit(f"permitq_example: {external_id} ended {row[0]}: {row[1]}{hint}")
        print(f"acquired with fencing token {row[2]}")
        for _ in range(2):  # the work, heartbeating every ttl/3 in real life
            (expires,) = conn.execute("SELECT permitq.heartbeat(%s)", (external_id,)).fetchone()
            print(f"heartbeat: lease until {expires.isoformat()}")
        (outcome,) = conn.execute("SELECT permitq.release(%s)", (external_id,)).fetchone()
        print(f"release: {outcome}")
        return 0 if outcome == "released" else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except psycopg.errors.InvalidSchemaName:
        raise SystemExit("permitq_example: this database has no permitq schema yet: run `permitq migrate` first")
    except psycopg.errors.UndefinedFunction as e:
        message = " ".join(str(e).split())
        raise SystemExit(f"permitq_example: {message} (the permitq schema is older than this example: run `permitq migrate`)")
    except psycopg.Error as e:
        message = " ".join(str(e).split())
        raise SystemExit(f"permitq_example: {message}")
