"""Support of the cluster tests: a gate that holds a transaction just before its COMMIT
(so two nodes can both pass their fences locally before either commits), a recorder of
the errors an engine saw at COMMIT, and per-node stores/workers over one test database."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import ExceptionContext
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.util import await_only

from runtime_svc.kernel import FlowRunStateStore
from services import db
from services.db_batch import CARRY_COMMIT_OPTION
from tests.integration.kernel.conftest import ShiftedClock
from tests.integration.worker.conftest import WORKER_POLICY

__all__ = [
    "CLUSTER_POLICY",
    "CommitErrors",
    "CommitGate",
    "Node",
    "commit_errors",
    "count",
    "count_sync",
    "nodes",
]

#: Minutes-long delays reached by shifting the clock (never by sleeping), as in the
#: worker tests.
CLUSTER_POLICY = WORKER_POLICY


_GATE_TIMEOUT_S = 60.0


class CommitGate:
    """Holds the next COMMIT on ``engine`` until :meth:`open` (one shot per :meth:`arm`).

    The ``commit`` event fires on the engine's sync facade right before the driver sends
    ``COMMIT``; the listener parks that greenlet on an asyncio event (``await_only``),
    so every statement of the transaction has run — its conditional UPDATEs included —
    and only the COMMIT is outstanding. That moment exists only while the COMMIT goes
    on its own, so the gate keeps the engine's COMMITs off its last writes' round trip
    (``services.db_batch.CARRY_COMMIT_OPTION``) until :meth:`remove`; the carried path's
    own race is ``test_cluster_fencing``'s carried-commit test.
    """

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._armed = False
        self.reached = asyncio.Event()
        self._open = asyncio.Event()
        engine.sync_engine.update_execution_options(**{CARRY_COMMIT_OPTION: False})
        event.listen(engine.sync_engine, "commit", self._on_commit)

    def arm(self) -> None:
        self._armed = True
        self.reached.clear()
        self._open.clear()

    def open(self) -> None:
        self._open.set()

    async def wait_reached(self, timeout_s: float = 30.0) -> None:
        await asyncio.wait_for(self.reached.wait(), timeout_s)

    def _on_commit(self, _conn: Any) -> None:
        if not self._armed:
            return
        self._armed = False
        self.reached.set()
        # Bounded: a failing test must not leave a transaction parked for ever.
        await_only(asyncio.wait_for(self._open.wait(), _GATE_TIMEOUT_S))

    def remove(self) -> None:
        event.remove(self._engine.sync_engine, "commit", self._on_commit)
        self._engine.sync_engine.update_execution_options(**{CARRY_COMMIT_OPTION: True})


@dataclass
class CommitErrors:
    """Driver error codes an engine saw while committing (``statement`` is None then)."""

    codes: list[int] = field(default_factory=list)


@contextmanager
def commit_errors(engine: AsyncEngine) -> Iterator[CommitErrors]:
    found = CommitErrors()

    def on_error(ctx: ExceptionContext) -> None:
        orig = ctx.original_exception
        if ctx.statement is None and orig.args and isinstance(orig.args[0], int):
            found.codes.append(int(orig.args[0]))

    event.listen(engine.sync_engine, "handle_error", on_error)
    try:
        yield found
    finally:
        event.remove(engine.sync_engine, "handle_error", on_error)


@dataclass
class Node:
    """One cluster node as a worker process would see it: its engine and kernel store."""

    index: int
    engine: AsyncEngine
    store: FlowRunStateStore


def nodes(engines: list[AsyncEngine], clock: ShiftedClock | None = None) -> list[Node]:
    """A store per node, all on one shiftable clock."""
    shifted = clock or ShiftedClock()
    return [
        Node(i, e, FlowRunStateStore(e, policy=CLUSTER_POLICY, clock=shifted))
        for i, e in enumerate(engines)
    ]


async def count(engine: AsyncEngine, sql: str, **params: object) -> int:
    from sqlalchemy import text

    async with db.transaction(engine, readonly=True) as conn:
        return int((await conn.execute(text(sql), params)).scalar_one())


def count_sync(url: str, sql: str, *params: object) -> int:
    """One ``COUNT`` through a plain pymysql connection to the node of ``url`` (for
    synchronous tests; the query is a causal read like every service connection's)."""
    from tests.cluster.conftest import connect

    conn = connect(url)
    try:
        with conn.cursor() as cursor:
            cursor.execute("SET SESSION wsrep_sync_wait = 1")
            cursor.execute(sql, params)
            row = cursor.fetchone()
            return int(row[0]) if row else 0
    finally:
        conn.close()
