"""A schema-upgrade lock that holds across every node of a database cluster.

Two replicas started with ``FLOW_DB_AUTO_MIGRATE=true`` must not both run ``CREATE
TABLE``. ``GET_LOCK`` cannot serialise them on a cluster: on MariaDB Galera it is
node-local (two replicas on two nodes both get it). This lock is a *row*: acquiring it
is an ``INSERT`` of the lock's primary key (or a conditional ``UPDATE`` taking over an
expired lease) whose ``COMMIT`` must succeed — on Galera the loser of a concurrent
acquisition fails at certification (1213) and tries again; on a single server or TiDB
the unique key decides. The holder renews a lease while it works, so a holder that
died leaves a lock the next upgrader takes over once the lease ran out.

The table (:data:`LOCK_TABLE`) lives beside each service's schema but is not part of
it: it is created on first use and ``db verify`` ignores it. Times come from the
database clock (:func:`services.db.db_now`), so replicas with skewed clocks agree; nodes of
one cluster must keep their clocks within a fraction of the lease (NTP).

SQLite needs none of this: a migration there is one ``BEGIN IMMEDIATE`` transaction
(the single writer lock serialises upgraders).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta

from sqlalchemy import Column, MetaData, String, Table, delete, insert, select, text, update
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from services.db import DbErrorClass, UtcDateTime, classify_db_error, db_now, transaction
from services.errors import CommitOutcomeUnknownError

__all__ = [
    "DEFAULT_LEASE_S",
    "DEFAULT_WAIT_S",
    "LOCK_TABLE",
    "SchemaLockLostError",
    "SchemaLockTimeoutError",
    "schema_lock",
]

log = logging.getLogger(__name__)

#: The lock table (one row per held lock). ``db verify`` leaves it out of the comparison.
LOCK_TABLE = "flow_schema_lock"
#: Lease of a held lock; renewed every third of it.
DEFAULT_LEASE_S = 60
#: How long an upgrader waits for another one to finish.
DEFAULT_WAIT_S = 300

# A constant statement (not built from LOCK_TABLE) so no SQL is ever assembled at run time.
_CREATE = text(
    "CREATE TABLE IF NOT EXISTS flow_schema_lock ("
    " lock_name VARCHAR(64) NOT NULL,"
    " holder VARCHAR(200) NOT NULL,"
    " acquired_at DATETIME(6) NOT NULL,"
    " expires_at DATETIME(6) NOT NULL,"
    " PRIMARY KEY (lock_name)"
    ") ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin"
)
_lock = Table(
    LOCK_TABLE,
    MetaData(),  # not any service's schema metadata: Alembic never manages this table
    Column("lock_name", String(64), primary_key=True),
    Column("holder", String(200), nullable=False),
    Column("acquired_at", UtcDateTime(), nullable=False),
    Column("expires_at", UtcDateTime(), nullable=False),
)


class SchemaLockTimeoutError(TimeoutError):
    """Another process held the schema lock for longer than the wait."""


class SchemaLockLostError(RuntimeError):
    """The lease ran out while this process held the lock (another upgrader may have
    taken it over): the upgrade's outcome must be checked with ``db verify``."""


async def _holder_of(engine: AsyncEngine, name: str) -> str | None:
    async with transaction(engine, readonly=True) as conn:
        holder = (
            await conn.execute(select(_lock.c.holder).where(_lock.c.lock_name == name))
        ).scalar_one_or_none()
    return None if holder is None else str(holder)


async def _try_acquire(engine: AsyncEngine, name: str, holder: str, lease_s: int) -> bool:
    """One attempt: insert the lock row, or take over an expired one. True when this
    holder owns the lock after a successful COMMIT."""
    lease = timedelta(seconds=lease_s)
    try:
        async with transaction(engine) as conn:
            now = await db_now(conn)
            await conn.execute(
                insert(_lock).values(
                    lock_name=name, holder=holder, acquired_at=now, expires_at=now + lease
                )
            )
        return True
    except DBAPIError as exc:
        kind = classify_db_error(exc)
        if kind is DbErrorClass.RETRYABLE_CONFLICT:
            return False  # a concurrent acquisition on another node won certification
        if kind is not DbErrorClass.DUPLICATE_KEY:
            raise
    try:
        async with transaction(engine) as conn:
            now = await db_now(conn)
            taken = await conn.execute(
                update(_lock)
                .where(_lock.c.lock_name == name, _lock.c.expires_at < now)
                .values(holder=holder, acquired_at=now, expires_at=now + lease)
            )
            took_over = taken.rowcount == 1
        if took_over:
            log.warning("schema lock %s: took over an expired lease", name)
        return took_over
    except DBAPIError as exc:
        if classify_db_error(exc) in (
            DbErrorClass.RETRYABLE_CONFLICT,
            DbErrorClass.LOCK_WAIT_TIMEOUT,
        ):
            return False
        raise


async def _renew(engine: AsyncEngine, name: str, holder: str, lease_s: int) -> bool:
    async with transaction(engine) as conn:
        now = await db_now(conn)
        result = await conn.execute(
            update(_lock)
            .where(_lock.c.lock_name == name, _lock.c.holder == holder)
            .values(expires_at=now + timedelta(seconds=lease_s))
        )
        return result.rowcount == 1


async def _release(engine: AsyncEngine, name: str, holder: str) -> None:
    async with transaction(engine) as conn:
        await conn.execute(delete(_lock).where(_lock.c.lock_name == name, _lock.c.holder == holder))


@asynccontextmanager
async def schema_lock(
    engine: AsyncEngine,
    name: str,
    *,
    lease_s: int = DEFAULT_LEASE_S,
    wait_s: float = DEFAULT_WAIT_S,
    poll_s: float = 0.25,
) -> AsyncIterator[str]:
    """Hold the cluster-wide lock ``name`` for the body; yields the holder id.

    The engine needs two connections (the body's and the lease renewal's).

    Raises:
        SchemaLockTimeoutError: not acquired within ``wait_s``.
        SchemaLockLostError: the lease could not be renewed while the body ran.
    """
    if lease_s < 3:
        raise ValueError("lease_s must be >= 3")
    holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"
    async with engine.connect() as conn:
        await conn.execute(_CREATE)
        await conn.commit()
    deadline = time.monotonic() + wait_s
    while True:
        try:
            acquired = await _try_acquire(engine, name, holder, lease_s)
        except CommitOutcomeUnknownError:
            # The COMMIT of our INSERT/UPDATE may have landed: the row says whose it is.
            acquired = await _holder_of(engine, name) == holder
        if acquired:
            break
        if time.monotonic() >= deadline:
            raise SchemaLockTimeoutError(
                f"schema lock {name} is held by {await _holder_of(engine, name)!r}"
            )
        await asyncio.sleep(poll_s)

    lost = asyncio.Event()

    async def renew() -> None:
        while True:
            await asyncio.sleep(lease_s / 3)
            try:
                if not await _renew(engine, name, holder, lease_s):
                    log.error("schema lock %s: lease lost while upgrading", name)
                    lost.set()
                    return
            except Exception:
                log.warning("schema lock %s: renewal failed; retrying", name, exc_info=True)

    renewer = asyncio.create_task(renew(), name=f"schema-lock-{name}")
    try:
        yield holder
    finally:
        renewer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await renewer
        try:
            await _release(engine, name, holder)
        except Exception:
            # The lease runs out on its own; the next upgrader takes it over then.
            log.warning("schema lock %s: release failed", name, exc_info=True)
    if lost.is_set():
        raise SchemaLockLostError(f"schema lock {name}: lease lost while it was held")
