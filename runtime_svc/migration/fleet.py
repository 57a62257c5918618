"""The FlowInterview writer fleet: registration with a start guard, heartbeats, and the
drain gate's authoritative evidence (§20.3 3, §22.8 "authoritative fleet and
active-transaction evidence proves zero pre-bridge writers").

Every bridge-aware process registers *before it serves or schedules*:
:func:`register_writer` locks the control record, applies
:func:`~runtime_svc.migration.gates.startup_refusal` to the binary's generation and only
then inserts its registry row — all in one transaction. The drain gate takes the same
lock, so a pre-bridge binary starting concurrently either registers before the gate
(and the gate sees a live pre-bridge writer and refuses) or after it (and is refused).
A live writer is one not stopped whose lease has not expired; it heartbeats its lease.

The active-transaction evidence is read from the database server itself
(:func:`open_transactions_before`): on MySQL-family servers every InnoDB transaction
of a session using this deployment's database that started before the drain and is still
open (it may be a pre-bridge write that has not committed yet); on SQLite the gate's own
``BEGIN IMMEDIATE`` holds the single write lock, which proves no other write transaction
is open.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select, text, update
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.migration.control import lock_control_txn
from runtime_svc.migration.gates import startup_refusal
from runtime_svc.migration.protocol import BinaryRefusedError
from runtime_svc.schema_bridge import flow_interview_writers
from services.db import db_now, transaction

__all__ = [
    "DEFAULT_WRITER_LEASE",
    "WriterRegistration",
    "heartbeat_writer",
    "live_writers_txn",
    "open_transactions_before",
    "register_writer",
    "stop_writer",
]

log = logging.getLogger(__name__)

#: How long a registration stays live without a heartbeat.
DEFAULT_WRITER_LEASE = timedelta(seconds=60)


@dataclass(frozen=True)
class WriterRegistration:
    """One registered process."""

    process_id: str
    binary_version: str
    generation: int
    compiler_version: str
    host: str


async def register_writer(
    engine: AsyncEngine,
    registration: WriterRegistration,
    *,
    lease: timedelta = DEFAULT_WRITER_LEASE,
) -> None:
    """Register a starting process, or refuse it (see the module docstring).

    Raises:
        BinaryRefusedError: the control record has left this binary's generation behind.
    """
    async with transaction(engine) as conn:
        control = await lock_control_txn(conn)
        refusal = startup_refusal(control, registration.generation)
        if refusal is not None:
            raise BinaryRefusedError(refusal, registration.generation)
        now = await db_now(conn)
        await conn.execute(
            flow_interview_writers.insert().values(
                process_id=registration.process_id,
                binary_version=registration.binary_version,
                write_protocol_generation=registration.generation,
                compiler_version=registration.compiler_version,
                host=registration.host[:128],
                started_at=now,
                heartbeat_at=now,
                lease_until=now + lease,
                stopped_at=None,
                state_version=0,
            )
        )


async def heartbeat_writer(
    engine: AsyncEngine, process_id: str, *, lease: timedelta = DEFAULT_WRITER_LEASE
) -> bool:
    """Extend a live registration (``False``: it was stopped)."""
    t = flow_interview_writers.c
    async with transaction(engine) as conn:
        now = await db_now(conn)
        result = await conn.execute(
            update(flow_interview_writers)
            .where(t.process_id == process_id, t.stopped_at.is_(None))
            .values(
                heartbeat_at=now,
                lease_until=now + lease,
                state_version=t.state_version + 1,
            )
        )
        return result.rowcount == 1


async def stop_writer(engine: AsyncEngine, process_id: str) -> None:
    """Mark a registration stopped (graceful shutdown)."""
    t = flow_interview_writers.c
    async with transaction(engine) as conn:
        now = await db_now(conn)
        await conn.execute(
            update(flow_interview_writers)
            .where(t.process_id == process_id, t.stopped_at.is_(None))
            .values(stopped_at=now, state_version=t.state_version + 1)
        )


async def live_writers_txn(conn: AsyncConnection, now: datetime) -> list[dict[str, Any]]:
    """Every live registration (not stopped, lease not expired), oldest first."""
    t = flow_interview_writers.c
    stmt = (
        select(
            t.process_id,
            t.binary_version,
            t.write_protocol_generation,
            t.compiler_version,
            t.host,
            t.started_at,
            t.heartbeat_at,
        )
        .where(t.stopped_at.is_(None), t.lease_until > now)
        .order_by(t.started_at, t.process_id)
    )
    out = []
    for r in (await conn.execute(stmt)).mappings():
        row = dict(r)
        row["started_at"] = row["started_at"].isoformat()
        row["heartbeat_at"] = row["heartbeat_at"].isoformat()
        out.append(row)
    return out


async def open_transactions_before(
    conn: AsyncConnection, started_before: datetime, now: datetime
) -> tuple[int | None, str]:
    """Open transactions (other than this one) that began before ``started_before``.

    Returns ``(count, evidence kind)``; ``count`` is ``None`` when the server cannot
    produce the evidence (the drain gate then refuses: fail closed).
    """
    dialect = conn.dialect.name
    if dialect == "sqlite":
        # The caller's transaction is BEGIN IMMEDIATE: it holds SQLite's one write lock.
        return 0, "sqlite_write_lock"
    age = max(0.0, (now - started_before).total_seconds())
    try:
        count = (
            await conn.execute(
                text(
                    "SELECT COUNT(*) FROM information_schema.INNODB_TRX t "
                    "JOIN information_schema.PROCESSLIST p ON p.ID = t.trx_mysql_thread_id "
                    "WHERE p.DB = DATABASE() AND t.trx_mysql_thread_id <> CONNECTION_ID() "
                    "AND t.trx_started <= NOW(6) - INTERVAL :age SECOND"
                ),
                {"age": age},
            )
        ).scalar_one()
    except DBAPIError as exc:
        log.warning("no active-transaction evidence from the server: %s", exc.orig)
        return None, "innodb_trx_unavailable"
    return int(count), "innodb_trx"
