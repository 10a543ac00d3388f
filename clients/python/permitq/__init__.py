"""permitq for Python producers: submit permit requests, acquire with a heartbeating lease and
its fencing token, release; errors as types. A thin layer over permitq's SQL API (psycopg 3).

    from permitq import Client

    with Client("postgres://app@db/app") as client:
        with client.acquire("train-7", {"gpu": 2}, ttl=30, timeout=600) as lease:
            while work_left():
                lease.check()                      # raises LeaseLost before the lease can run out
                write(lease.fencing_token)

`AsyncClient` is the same for asyncio (`async with client.acquire(...) as lease`).
"""

from ._async import AsyncClient, AsyncLease
from ._common import Explanation, Semaphore, SemaphoreWait, Status
from ._errors import (
    AcquireTimeout,
    Cancelled,
    DatabaseUnavailable,
    ExceedsCapacity,
    ExternalIdTaken,
    InvalidInput,
    InvalidRequest,
    LeaseLost,
    LoginRejected,
    NoCapacity,
    NoLeaseYet,
    NotOwner,
    PermitqError,
    RequestFailed,
    RoleMissing,
    TooManyInstances,
    UnknownRequest,
    UnknownSemaphore,
    WaitTimedOut,
)
from ._sync import Client, Lease

# Tracebacks name the public module (`permitq.UnknownSemaphore`), not the private one.
for _name in ("AcquireTimeout", "Cancelled", "DatabaseUnavailable", "ExceedsCapacity",
              "ExternalIdTaken", "InvalidInput", "InvalidRequest", "LeaseLost", "LoginRejected",
              "NoCapacity", "NoLeaseYet", "NotOwner", "PermitqError", "RequestFailed",
              "RoleMissing", "TooManyInstances", "UnknownRequest", "UnknownSemaphore",
              "WaitTimedOut"):
    globals()[_name].__module__ = __name__
del _name

__all__ = [
    "AcquireTimeout",
    "AsyncClient",
    "AsyncLease",
    "Cancelled",
    "Client",
    "DatabaseUnavailable",
    "ExceedsCapacity",
    "Explanation",
    "ExternalIdTaken",
    "InvalidInput",
    "InvalidRequest",
    "Lease",
    "LeaseLost",
    "LoginRejected",
    "NoCapacity",
    "NoLeaseYet",
    "NotOwner",
    "PermitqError",
    "RequestFailed",
    "RoleMissing",
    "Semaphore",
    "SemaphoreWait",
    "Status",
    "TooManyInstances",
    "UnknownRequest",
    "UnknownSemaphore",
    "WaitTimedOut",
]
