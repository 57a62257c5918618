"""Per-key run concurrency limits: durable, fenced slots (issue 14 item 3).

Two keys exist: the Flow (``flow:<api>``, ``admission.flows.<api>.max_concurrent_runs``)
and the record a run is about (``record:<object>:<id>``,
``admission.records.<object>.max_concurrent_runs``: at most N live runs per record of that
object, whatever their Flow — the after-save trigger records the saved record as the run's
subject, ``flow_runs.subject_record_key``). A run under both limits holds a slot of each.

"At most N concurrent runs of this Flow" must hold across every worker process and
replica, so it cannot be an in-process counter, and a ``SELECT COUNT(*)`` followed by a
claim can be raced into N+1. Instead a run *holds a slot*: a row of ``flow_run_slots``
with ``slot_no`` in ``0 .. N-1``. The primary key ``(org_id, slot_key, slot_no)`` makes
"at most N holders" a uniqueness fact of the database — two racing acquirers of the same
free slot cannot both commit their INSERT — and ``(org_id, slot_key, flow_run_id)`` is
unique too, so a run racing itself (two workers, the same run) holds one slot, not two.
ARCHITECTURE §2: INSERT + catch duplicate, never an upsert.

A run acquires its slot before its first claim is admitted (the worker asks admission
before it claims; :class:`~runtime_svc.admission.controller.AdmissionController`) and
keeps it while it is not terminal — waiting included: a waiting run is still running.
When every slot is held, the holders whose runs are terminal, deleted or gone are
reclaimed by a fenced ``DELETE … WHERE slot_no = ? AND flow_run_id = <holder>`` (a holder
that changed meanwhile is left alone) and the acquire tries again once. A refused run
stays ``Runnable`` and is simply not claimed: it is offered again on a later pass,
without any write.

A lowered limit applies to new acquisitions: a run is admitted only while fewer than N
live holders exist *and* a slot below N is free; holders above the new N drain as their
runs end.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import and_, delete, false, or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.kernel.states import TERMINAL_RUN_STATES
from runtime_svc.schema import flow_run_slots, flow_runs
from services.db import db_now, run_in_transaction, transaction

__all__ = [
    "RunSlots",
    "SlotHolder",
    "flow_slot_key",
    "record_slot_key",
    "record_subject_key",
    "subject_object",
]

_TERMINAL_CODES = tuple(sorted(s.code for s in TERMINAL_RUN_STATES))


def flow_slot_key(flow_api_name: str) -> str:
    """The slot key of the per-Flow run concurrency limit."""
    return f"flow:{flow_api_name}"


def record_subject_key(object_name: str, record_id: str) -> str:
    """``flow_runs.subject_record_key`` of a run about this record."""
    return f"{object_name}:{record_id}"


def subject_object(subject_record_key: str) -> str:
    """The object name of a subject record key."""
    return subject_record_key.partition(":")[0]


def record_slot_key(subject_record_key: str) -> str:
    """The slot key of the per-record run concurrency limit."""
    return f"record:{subject_record_key}"


@dataclass(frozen=True)
class SlotHolder:
    slot_no: int
    flow_run_id: str
    live: bool


class RunSlots:
    """Slot acquisition against the runtime database (see the module docstring)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    async def holders(self, org_id: str, slot_key: str) -> list[SlotHolder]:
        """Every holder of ``slot_key`` with whether its run is still live."""
        s, r = flow_run_slots.c, flow_runs.c
        stmt = (
            select(s.slot_no, s.flow_run_id, r.runtime_state, r.is_deleted)
            .select_from(
                flow_run_slots.outerjoin(
                    flow_runs, and_(r.org_id == s.org_id, r.flow_run_id == s.flow_run_id)
                )
            )
            .where(s.org_id == org_id, s.slot_key == slot_key)
            .order_by(s.slot_no)
        )
        async with transaction(self._engine, readonly=True) as conn:
            rows = (await conn.execute(stmt)).all()
        return [
            SlotHolder(
                int(no),
                str(run),
                state is not None and state not in _TERMINAL_CODES and not deleted,
            )
            for no, run, state, deleted in rows
        ]

    async def subject_of(self, org_id: str, flow_run_id: str) -> str | None:
        """The run's subject record key (None: no subject, or no such run)."""
        r = flow_runs.c
        stmt = select(r.subject_record_key).where(r.org_id == org_id, r.flow_run_id == flow_run_id)
        async with transaction(self._engine, readonly=True) as conn:
            value = (await conn.execute(stmt)).scalar_one_or_none()
        return None if value is None else str(value)

    async def acquire(self, org_id: str, slot_key: str, flow_run_id: str, limit: int) -> bool:
        """True when ``flow_run_id`` holds (or now took) one of ``limit`` slots of the key."""
        if limit < 1:
            return False
        for _ in range(2):
            holders = await self.holders(org_id, slot_key)
            if any(h.flow_run_id == flow_run_id for h in holders):
                return True
            live = [h for h in holders if h.live]
            stale = [h for h in holders if not h.live]
            taken = {h.slot_no for h in holders}
            free = [n for n in range(limit) if n not in taken]
            if stale and (len(live) >= limit or not free):
                await self._reclaim(org_id, slot_key, stale)
                continue  # read the holders again
            if len(live) >= limit:
                return False
            for slot_no in free:
                won = await self._insert(org_id, slot_key, slot_no, flow_run_id)
                if won is not None:
                    return won
            # Every free slot was taken by a racing acquirer: read once more.
        return False

    async def _insert(
        self, org_id: str, slot_key: str, slot_no: int, flow_run_id: str
    ) -> bool | None:
        """True: this run holds a slot of the key. None: the slot was taken meanwhile.

        The INSERT is its own transaction, retried whole on a deadlock or lock-wait
        timeout (InnoDB may pick one of two racing inserters of a key, or an inserter
        racing a reclaim, as the victim; the victim wrote nothing)."""

        async def insert(conn: AsyncConnection) -> None:
            await conn.execute(
                flow_run_slots.insert().values(
                    org_id=org_id,
                    slot_key=slot_key,
                    slot_no=slot_no,
                    flow_run_id=flow_run_id,
                    acquired_at=await db_now(conn),
                )
            )

        try:
            await run_in_transaction(self._engine, insert)
        except IntegrityError:
            # Either the slot number was taken by another run, or this run took another
            # slot of the key concurrently (the second unique key): tell them apart.
            held = await self.holders(org_id, slot_key)
            if any(h.flow_run_id == flow_run_id for h in held):
                return True
            return None
        return True

    async def _reclaim(self, org_id: str, slot_key: str, stale: list[SlotHolder]) -> int:
        """Delete the slots of ``stale`` holders, each fenced by its holder's run id (one
        transaction, retried whole on a deadlock or lock-wait timeout)."""
        if not stale:
            return 0
        s = flow_run_slots.c
        fences = [and_(s.slot_no == h.slot_no, s.flow_run_id == h.flow_run_id) for h in stale]

        async def reclaim(conn: AsyncConnection) -> int:
            result = await conn.execute(
                delete(flow_run_slots).where(
                    s.org_id == org_id, s.slot_key == slot_key, or_(false(), *fences)
                )
            )
            return int(result.rowcount or 0)

        return await run_in_transaction(self._engine, reclaim)
