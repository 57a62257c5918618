"""Retention of the request-dedupe ledgers (``services.request_dedupe``).

A ledger row lets a retried ``request_id`` replay its original response; after the
service's window (``FLOW_REQUEST_RETENTION_HOURS``) a retry is a new request and the row
can go. Every service runs one :class:`RequestRetention` loop per ledger in its background
group (``services.background`` lifecycle): each pass purges, in bounded transactions, the
expired rows of the next batch of orgs; the org rotation resumes after the last org
served, so a large tenant population is reached in full instead of the first orgs
forever (issue 10, item 1).

Usage::

    group.add(RequestRetention(engine, ledger, retention=timedelta(hours=168)))
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import delete, select, tuple_
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from services.background import BackgroundLoop, OrgRotation
from services.db import WORK_SCOPE, db_now, run_in_transaction, transaction
from services.request_dedupe import RequestLedger

__all__ = ["RequestRetention"]


class RequestRetention(BackgroundLoop):
    """The retention sweep of one ledger: every ``interval_s``, purge the rows older
    than ``retention`` (on the database clock) of the next batch of orgs.

    Args:
        engine: the service database.
        ledger: the ledger to purge.
        retention: how long a request id replays its response (``FLOW_REQUEST_RETENTION_HOURS``).
        interval_s: pause between passes.
        batch_size: rows per purge transaction.
        max_batches: purge transactions per org and pass.
        org_batch: orgs per pass.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        ledger: RequestLedger,
        *,
        retention: timedelta,
        interval_s: float = 300.0,
        batch_size: int = 500,
        max_batches: int = 10,
        org_batch: int = 100,
    ) -> None:
        if retention <= timedelta(0) or batch_size < 1 or max_batches < 1:
            raise ValueError("retention, batch_size and max_batches must be positive")
        super().__init__(f"{ledger.table.name}-retention", idle_s=interval_s, interval=True)
        self._engine = engine
        self.ledger = ledger
        self.retention = retention
        self._batch_size = batch_size
        self._max_batches = max_batches

        async def source(after: str | None, limit: int) -> list[str]:
            return await self.orgs(after=after, limit=limit)

        self._orgs = OrgRotation(source, batch=org_batch)

    async def orgs(self, *, after: str | None, limit: int) -> list[str]:
        """Orgs holding ledger rows, in org order after ``after`` (bounded: the sweep
        walks every org with a cursor instead of re-reading the first ``limit``)."""
        t = self.ledger.table
        stmt = select(t.c.org_id).group_by(t.c.org_id).order_by(t.c.org_id).limit(limit)
        if after is not None:
            stmt = stmt.where(t.c.org_id > after)
        async with transaction(self._engine, readonly=True) as conn:
            return [str(o) for o in (await conn.execute(stmt)).scalars()]

    async def purge(self, org_id: str, *, older_than: datetime, limit: int = 500) -> int:
        """Delete up to ``limit`` of ``org_id``'s rows created before ``older_than``
        (one bounded transaction, by primary key); returns how many went."""
        if limit < 1:
            raise ValueError("limit must be >= 1")
        t = self.ledger.table
        pk = [t.c[name] for name in (*WORK_SCOPE, "rpc_name", "request_id")]

        async def fn(conn: AsyncConnection) -> int:
            rows = (
                await conn.execute(
                    select(*pk)
                    .where(t.c.org_id == org_id, t.c.created_at < older_than)
                    .order_by(t.c.created_at)
                    .limit(limit)
                )
            ).all()
            if not rows:
                return 0
            result = await conn.execute(
                delete(t).where(
                    t.c.org_id == org_id,
                    t.c.created_at < older_than,
                    tuple_(*pk).in_([tuple(r) for r in rows]),
                )
            )
            return int(result.rowcount)

        return await run_in_transaction(self._engine, fn)

    async def sweep_once(self) -> int:
        """One pass over the next batch of orgs; returns the rows purged."""
        async with transaction(self._engine, readonly=True) as conn:
            cutoff = await db_now(conn) - self.retention
        purged = 0
        for org_id in await self._orgs.next_batch():
            for _ in range(self._max_batches):
                if self.stopping:
                    return purged
                n = await self.purge(org_id, older_than=cutoff, limit=self._batch_size)
                purged += n
                if n < self._batch_size:
                    break
        return purged

    async def run_once(self) -> bool:
        await self.sweep_once()
        return False  # a slow duty: always wait the interval
