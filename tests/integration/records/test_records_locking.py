"""Lock order under real concurrency on MariaDB (§13.1, §22.3).

Interleavings are forced, not hoped for: a transaction that holds its first lock waits
until the other transaction is observed *blocked on a row lock* (``INNODB_TRX`` in
``LOCK WAIT``, restricted to this test's database) before it goes on. Deadlocks are
counted by classifying every error that leaves a transaction attempt (MySQL 1213 is
:attr:`DbErrorClass.RETRYABLE_CONFLICT`).
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.records import (
    Actor,
    Lineage,
    MutationKind,
    MutationResult,
    RecordEngine,
    RecordMutation,
    RecordState,
    StaleVersionError,
    acquire_locks_txn,
    apply_mutation_txn,
    plan_mutation,
    prepare_create,
    prepare_update,
)
from runtime_svc.records import store as record_store
from runtime_svc.records.store import lock_record_history_txn
from runtime_svc.resources import LockPlan, ResourceKey, business_key
from runtime_svc.schema import audit_records, business_events, record_history_sequences, records
from services import db
from services.db import DbErrorClass, classify_db_error, run_in_transaction
from services.errors import ConflictError
from tests.integration.records.support import (
    count,
    record_view,
    sequences,
    wait_for_lock_waiters,
)

pytestmark = pytest.mark.mariadb

VIEW = record_view()
ACTOR = Actor("workload", "locking-test")
_BOUND_S = 30.0  # bound on any wait for the other transaction (never a timing assertion)


def _observed(
    fn: Callable[[AsyncConnection], Awaitable[Any]], seen: Counter[DbErrorClass]
) -> Callable[[AsyncConnection], Awaitable[Any]]:
    async def run(conn: AsyncConnection) -> Any:
        try:
            return await fn(conn)
        except Exception as exc:
            seen[classify_db_error(exc)] += 1
            raise

    return run


def _update(obj: str, rid: str, **fields: Any) -> RecordMutation:
    # Flow-style: the expected version is the one read under lock.
    return RecordMutation(MutationKind.UPDATE, obj, rid, fields)


async def _parent_and_child(rec: RecordEngine, org: str) -> None:
    await rec.mutate(
        org, VIEW, prepare_create(VIEW, "Account", "acc-1", {"Name": "P"}), actor=ACTOR
    )
    await rec.mutate(
        org, VIEW, prepare_create(VIEW, "Contact", "con-1", {"AccountId": "acc-1"}), actor=ACTOR
    )


async def _step(
    conn: AsyncConnection,
    org: str,
    mutations: list[RecordMutation],
    *,
    on_locked: Callable[[ResourceKey], Awaitable[None]] | None = None,
    lineage: Lineage | None = None,
) -> list[MutationResult]:
    """One Flow-step transaction: the union plan of all mutations (declared order is
    irrelevant) from a planning read of their rows, locks, then the mutations in declared
    order."""
    plan = LockPlan()
    for m in mutations:
        current = await record_store.read_record_txn(conn, org, m.object_name, m.record_id)
        plan = plan.union(plan_mutation(VIEW, m, current))
    locks = await acquire_locks_txn(conn, org, VIEW, plan, mutations, on_locked=on_locked)
    return [
        await apply_mutation_txn(conn, org, VIEW, m, locks, actor=ACTOR, lineage=lineage)
        for m in mutations
    ]


async def test_parent_child_in_opposite_metadata_orders_do_not_deadlock(
    maria_engine: AsyncEngine, org: str
) -> None:
    """Two steps touch parent and child in different declared orders. With the canonical
    order both lock the parent first, so the second waits instead of closing a cycle."""
    rec = RecordEngine(maria_engine)
    await _parent_and_child(rec, org)
    seen: Counter[DbErrorClass] = Counter()
    first_locks: list[ResourceKey] = []
    holder_has_first = asyncio.Event()

    async def holder_hook(key: ResourceKey) -> None:
        if not first_locks:
            first_locks.append(key)
            holder_has_first.set()
            await wait_for_lock_waiters(maria_engine, 1)  # the other step is now blocked

    child_first = [
        _update("Contact", "con-1", LastName="A"),
        _update("Account", "acc-1", Employees=1),
    ]
    parent_first = [
        _update("Account", "acc-1", Employees=2),
        _update("Contact", "con-1", LastName="B"),
    ]

    async def run_holder() -> list[MutationResult]:
        return await run_in_transaction(
            maria_engine,
            _observed(lambda c: _step(c, org, child_first, on_locked=holder_hook), seen),
            max_attempts=1,  # a deadlock would fail the test instead of being retried
        )

    async def run_waiter() -> list[MutationResult]:
        await asyncio.wait_for(holder_has_first.wait(), _BOUND_S)
        return await run_in_transaction(
            maria_engine, _observed(lambda c: _step(c, org, parent_first), seen), max_attempts=1
        )

    held, waited = await asyncio.gather(run_holder(), run_waiter())
    # The child-first step still locked the parent first.
    assert first_locks == [business_key("Account", "acc-1")]
    assert seen == Counter()  # no deadlock, no lock-wait timeout, nothing retried
    assert [r.record.version for r in held] == [2, 2]
    assert [r.record.version for r in waited] == [3, 3]
    assert await sequences(maria_engine, org, "Account", "acc-1") == [1, 2, 3]
    assert await sequences(maria_engine, org, "Contact", "con-1") == [1, 2, 3]


async def test_many_concurrent_opposite_order_steps_never_deadlock(
    maria_engine: AsyncEngine, org: str
) -> None:
    rec = RecordEngine(maria_engine)
    await _parent_and_child(rec, org)
    seen: Counter[DbErrorClass] = Counter()
    n = 16

    async def one(i: int) -> None:
        ms = [
            _update("Contact", "con-1", LastName=f"n{i}"),
            _update("Account", "acc-1", Employees=i),
        ]
        if i % 2:
            ms.reverse()
        await run_in_transaction(
            maria_engine, _observed(lambda c: _step(c, org, ms), seen), max_attempts=1
        )

    await asyncio.gather(*(one(i) for i in range(n)))
    assert seen == Counter()
    assert await sequences(maria_engine, org, "Account", "acc-1") == list(range(1, n + 2))
    assert await sequences(maria_engine, org, "Contact", "con-1") == list(range(1, n + 2))


async def test_deadlock_victim_rolls_back_and_retries_from_the_same_input(
    maria_engine: AsyncEngine, org: str
) -> None:
    """Control for the test above: a path that acquires its second row *late* (a second
    plan after writing the first row), in opposite orders, really deadlocks (1213). The
    victim's whole transaction — including its first write, event and audit row — rolls
    back and runs again from the same mutations; every effect ends up exactly once."""
    rec = RecordEngine(maria_engine)
    for rid in ("dl-x", "dl-y"):
        await rec.mutate(
            org, VIEW, prepare_create(VIEW, "Account", rid, {"Name": rid}), actor=ACTOR
        )
    seen: Counter[DbErrorClass] = Counter()
    x_locked, y_locked = asyncio.Event(), asyncio.Event()
    attempts: Counter[str] = Counter()

    def late_acquirer(
        name: str, first: str, second: str, mine: asyncio.Event, other: asyncio.Event
    ) -> Callable[[AsyncConnection], Awaitable[list[MutationResult]]]:
        async def step(conn: AsyncConnection) -> list[MutationResult]:
            attempts[name] += 1
            out = [await _step(conn, org, [_update("Account", first, Employees=attempts[name])])]
            if attempts[name] == 1:  # force the crossing only on the first attempt
                mine.set()
                await asyncio.wait_for(other.wait(), _BOUND_S)
            out.append(await _step(conn, org, [_update("Account", second, Balance=1)]))
            return [r for rs in out for r in rs]

        return step

    await asyncio.gather(
        run_in_transaction(
            maria_engine, _observed(late_acquirer("t1", "dl-x", "dl-y", x_locked, y_locked), seen)
        ),
        run_in_transaction(
            maria_engine, _observed(late_acquirer("t2", "dl-y", "dl-x", y_locked, x_locked), seen)
        ),
    )
    assert seen[DbErrorClass.RETRYABLE_CONFLICT] == 1  # exactly one 1213, one victim
    assert sorted(attempts.values()) == [1, 2]  # the victim ran again, whole
    for rid in ("dl-x", "dl-y"):
        state = await rec.get(org, "Account", rid)
        assert state.version == 3  # create + one write from each transaction, no more
        assert await sequences(maria_engine, org, "Account", rid) == [1, 2, 3]
        assert await count(maria_engine, business_events, org, record_id=rid) == 3
        assert await count(maria_engine, audit_records, org, record_id=rid) == 3


async def test_flow_step_holding_the_row_makes_an_ordinary_write_wait_then_abort(
    maria_engine: AsyncEngine, org: str
) -> None:
    """A Flow step and an ordinary UpdateRecord contend on one business row: the ordinary
    write waits for the step's lock, then its compare-and-swap sees the step's commit and
    fails ABORTED (stale version) without writing anything."""
    rec = RecordEngine(maria_engine)
    await _parent_and_child(rec, org)
    flow_locked = asyncio.Event()

    async def hook(key: ResourceKey) -> None:
        if not flow_locked.is_set():
            flow_locked.set()
            await wait_for_lock_waiters(maria_engine, 1)

    async def flow_step() -> list[MutationResult]:
        return await run_in_transaction(
            maria_engine,
            lambda c: _step(
                c,
                org,
                [_update("Contact", "con-1", LastName="Flow")],
                on_locked=hook,
                lineage=Lineage("run-1", "step-1", "attempt-1"),
            ),
            max_attempts=1,
        )

    async def ordinary() -> MutationResult:
        await asyncio.wait_for(flow_locked.wait(), _BOUND_S)
        return await rec.mutate(
            org,
            VIEW,
            prepare_update(VIEW, "Contact", "con-1", 1, {"LastName": "Ordinary"}),
            actor=ACTOR,
        )

    flow_result, ordinary_result = await asyncio.gather(
        flow_step(), ordinary(), return_exceptions=True
    )
    assert not isinstance(flow_result, BaseException)
    assert isinstance(ordinary_result, StaleVersionError)
    assert ordinary_result.found_version == 2
    state = await rec.get(org, "Contact", "con-1")
    assert (state.version, state.fields["LastName"]) == (2, "Flow")
    assert await sequences(maria_engine, org, "Contact", "con-1") == [1, 2]
    assert await count(maria_engine, business_events, org, flow_run_id="run-1") == 1


async def test_ordinary_write_holding_the_row_makes_a_flow_step_wait_then_apply(
    maria_engine: AsyncEngine, org: str
) -> None:
    """The other direction: the ordinary write holds the row; the Flow step waits, then
    applies on top of the committed version (it admitted the row in its plan)."""
    ordinary_locked = asyncio.Event()

    async def hook(key: ResourceKey) -> None:
        if not ordinary_locked.is_set():
            ordinary_locked.set()
            await wait_for_lock_waiters(maria_engine, 1)

    rec = RecordEngine(maria_engine)
    await _parent_and_child(rec, org)
    hooked = RecordEngine(maria_engine, lock_hook=hook)

    async def ordinary() -> MutationResult:
        return await hooked.mutate(
            org,
            VIEW,
            prepare_update(VIEW, "Contact", "con-1", 1, {"LastName": "Ordinary"}),
            actor=ACTOR,
        )

    async def flow_step() -> list[MutationResult]:
        await asyncio.wait_for(ordinary_locked.wait(), _BOUND_S)
        return await run_in_transaction(
            maria_engine,
            lambda c: _step(
                c,
                org,
                [_update("Contact", "con-1", LastName="Flow")],
                lineage=Lineage("run-2", "step-1", "attempt-1"),
            ),
            max_attempts=1,
        )

    ordinary_result, flow_results = await asyncio.gather(ordinary(), flow_step())
    assert ordinary_result.record.version == 2
    assert flow_results[0].record.version == 3
    assert hooked.stats.conflict_retries == 0
    state = await rec.get(org, "Contact", "con-1")
    assert (state.version, state.fields["LastName"]) == (3, "Flow")
    assert await sequences(maria_engine, org, "Contact", "con-1") == [1, 2, 3]


async def test_record_mutation_and_history_reservation_contend(
    maria_engine: AsyncEngine, org: str
) -> None:
    """Concurrent writers of one record never hand out one history sequence twice and
    never leave a gap, because the history row is reserved under the record's lock."""
    rec = RecordEngine(maria_engine)
    await rec.mutate(org, VIEW, prepare_create(VIEW, "Account", "h-1", {"Name": "H"}), actor=ACTOR)
    n = 20

    async def writer(i: int) -> None:
        for _ in range(500):
            current = await rec.get(org, "Account", "h-1")
            try:
                await rec.mutate(
                    org,
                    VIEW,
                    prepare_update(VIEW, "Account", "h-1", current.version, {"Employees": i}),
                    actor=ACTOR,
                )
                return
            except ConflictError:
                await asyncio.sleep(0)
        raise AssertionError("writer never succeeded")

    await asyncio.gather(*(writer(i) for i in range(n)))
    assert (await rec.get(org, "Account", "h-1")).version == n + 1
    assert await sequences(maria_engine, org, "Account", "h-1") == list(range(1, n + 2))
    assert rec.stats.conflict_retries == 0


async def test_the_joined_record_and_history_lock_takes_the_record_first(
    maria_engine: AsyncEngine,
) -> None:
    """``lock_record_history_txn`` locks the record row before its history row (§13.1),
    proven on the server: while another transaction holds only the history row, the
    joined lock waits for it already holding the record row (a ``NOWAIT`` lock of the
    record fails), and finishes once the history row is released. Were the history row
    read first, the record would still be free while the joined lock waits."""
    org = f"org_{uuid.uuid4().hex[:12]}"
    rec = RecordEngine(maria_engine)
    created = await rec.mutate(
        org, VIEW, prepare_create(VIEW, "Note", "", {"Body": "x"}), actor=ACTOR
    )
    rid = created.record.record_id
    h, r = record_history_sequences.c, records.c
    async with maria_engine.connect() as holder:
        await holder.begin()
        await holder.execute(
            select(h.last_sequence)
            .where(h.org_id == org, h.object_name == "Note", h.record_id == rid)
            .with_for_update()
        )

        async def joined() -> tuple[RecordState | None, int | None]:
            async with db.transaction(maria_engine) as conn:
                return await lock_record_history_txn(conn, org, "Note", rid, clocked=False)

        waiter = asyncio.create_task(joined())
        try:
            await wait_for_lock_waiters(maria_engine)
            async with maria_engine.connect() as probe:
                await probe.begin()
                with pytest.raises(DBAPIError):
                    await probe.execute(
                        select(r.record_id)
                        .where(r.org_id == org, r.object_name == "Note", r.record_id == rid)
                        .with_for_update(nowait=True)
                    )
                await probe.rollback()
            assert not waiter.done()
        finally:
            await holder.rollback()
        row, last = await asyncio.wait_for(waiter, timeout=60)
    assert row is not None and row.version == 1 and last == 1
