"""permitq from Python, with the client package (clients/python, `import permitq`).

Acquires one GPU and one licence (submit, then wait on the `permitq_events` channel, re-reading
the status every 0.25 s so that a missed notification only costs time), works under the lease
(which heartbeats in the background), then releases.

    DATABASE_URL=postgres://app@db/app python3 examples/python/permitq_example.py

Needs Python 3.11+ with psycopg 3 (Debian: python3-psycopg; pip: psycopg[binary]) and the
package (`pip install ./clients/python`; from a clone it is found without installing), a running
worker (`permitq worker`), and the semaphores `gpu` and `licence`. Create them with `permitq
semaphore set gpu 4` and `permitq semaphore set licence 2`, or set PERMITQ_EXAMPLE_SETUP=1 and
the script creates them itself (the login then needs the permitq_admin role). Each run uses a
new request id. Exits 0 when the request was granted and released; otherwise 1 with one line on
stderr.
"""

import os
import pathlib
import sys
import uuid

try:
    import psycopg  # noqa: F401 - the package needs it
except ImportError:
    raise SystemExit(
        'permitq_example: needs psycopg 3 (pip install "psycopg[binary]", or Debian\'s python3-psycopg '
        "with /usr/bin/python3)"
    )
try:
    import permitq
except ImportError:  # from a clone, without installing the package
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "clients" / "python"))
    import permitq


def main() -> int:
    url = os.environ.get("DATABASE_URL")
    if not url:
        raise SystemExit("permitq_example: set DATABASE_URL")
    external_id = f"py-{uuid.uuid4().hex[:8]}"
    with permitq.Client(url) as client:
        if os.environ.get("PERMITQ_EXAMPLE_SETUP") == "1":
            client.set_capacity("gpu", 4)
            client.set_capacity("licence", 2)
        print(f"acquiring as {external_id}: gpu=1, licence=1, waiting up to 30s (`permitq explain {external_id}` says why it waits)")
        with client.acquire(external_id, {"gpu": 1, "licence": 1}, owner="python-example", ttl=30, wait=60, timeout=30) as lease:
            print(f"acquired with fencing token {lease.fencing_token}")
            for _ in range(2):  # the work; the lease heartbeats by itself every ttl/3
                lease.check()
                expires = client.heartbeat(external_id)
                print(f"heartbeat: lease until {expires.isoformat()}")
            outcome = lease.release()
        print(f"release: {outcome}")
        return 0 if outcome == "released" else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except permitq.UnknownSemaphore as e:
        raise SystemExit(f"permitq_example: {e} (create them: permitq semaphore set gpu 4; permitq semaphore set licence 2)")
    except permitq.AcquireTimeout as e:
        raise SystemExit(f"permitq_example: {e} (is a worker running?)")
    except permitq.PermitqError as e:
        raise SystemExit(f"permitq_example: {e}")
