"""permitq from Python, through the SQL API only (psycopg 3).

Submits a request for one GPU and one licence, waits for the outcome on the `permitq_events`
channel (re-reading `permitq.status` every second, so a missed notification only costs time),
heartbeats while "working", then releases.

    DATABASE_URL=postgres://app@db/app python3 examples/python/permitq_example.py

A worker must be running (`permitq worker`) and the semaphores must exist (`permitq semaphore
set gpu 4`, `permitq semaphore set licence 2`; this script creates them when it may).
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
    JSON array of outcomes), and re-reads the status at least every second anyway, so a missed
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
    url = os.environ["DATABASE_URL"]
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
        if row is None or row[0] != "acquired":
            print(f"not granted: {row}", file=sys.stderr)
            return 3
        print(f"acquired with fencing token {row[2]}")
        for _ in range(2):  # the work, heartbeating every ttl/3 in real life
            (expires,) = conn.execute("SELECT permitq.heartbeat(%s)", (external_id,)).fetchone()
            print(f"heartbeat: lease until {expires.isoformat()}")
        (outcome,) = conn.execute("SELECT permitq.release(%s)", (external_id,)).fetchone()
        print(f"release: {outcome}")
        return 0 if outcome == "released" else 1


if __name__ == "__main__":
    sys.exit(main())
