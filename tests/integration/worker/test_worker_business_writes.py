"""A mutation step's business writes go out after the lifecycle locks (§12.2 steps 9-11,
ADR 0011), on SQLite and MariaDB:

* every business transaction of a run locks and revalidates root, step and attempt
  before its event and audit rows (and, where the backend writes record and history in
  one statement, before the record's compare-and-swap); on MariaDB they are sent in the
  commit's round trip, before the output checkpoint and the final fenced UPDATE, and an
  update step's lifecycle locking read rides in its record lock's round trip (two round
  trips before the COMMIT);
* a fence lost at the lifecycle lock read sends none of them: the step is abandoned with
  the record, its history and its events untouched.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from sqlalchemy import event, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.kernel import FlowRunStateStore, LeaseFence, RunState
from runtime_svc.schema import business_events
from runtime_svc.worker import Outcome
from services import db
from services.db import strategy_for
from services.db_batch import statements_of
from tests.integration.kernel.helpers import count
from tests.integration.worker.support import (
    drive,
    make_worker,
    run_records,
    seed,
    start_run,
    step_counts,
)

#: What a transaction's end looks like in :func:`_round_trips`.
_END = "<end>"
#: The kernel's lifecycle lock read (``lock_fenced``: root, step and attempt, labelled).
_LOCK_READ = "flow_runs.org_id AS r_org_id"
_EVENT = "INSERT INTO business_events"
_AUDIT = "INSERT INTO audit_records"
_RECORD_CAS = "UPDATE records"


@contextmanager
def _round_trips(engine: AsyncEngine) -> Iterator[list[list[str]]]:
    """Every round trip ``engine`` sends in the block (its statements, whitespace
    collapsed), with ``[_END]`` where a transaction commits or rolls back."""
    trips: list[list[str]] = []

    def on_statement(*args: Any) -> None:
        trips.append([" ".join(s.split()) for s in statements_of(str(args[2]))])

    def on_end(*_: Any) -> None:
        trips.append([_END])

    sync = engine.sync_engine
    hooks = (("before_cursor_execute", on_statement), ("commit", on_end), ("rollback", on_end))
    for name, fn in hooks:
        event.listen(sync, name, fn)
    try:
        yield trips
    finally:
        for name, fn in hooks:
            event.remove(sync, name, fn)


def _transactions(trips: list[list[str]]) -> list[list[list[str]]]:
    """The round trips grouped by transaction (split at each end)."""
    out: list[list[list[str]]] = [[]]
    for trip in trips:
        if trip == [_END]:
            out.append([])
        else:
            out[-1].append(trip)
    return [t for t in out if t]


def _index(statements: list[str], marker: str) -> int:
    return next(i for i, s in enumerate(statements) if marker in s)


async def test_a_steps_business_writes_follow_its_lifecycle_lock_read(
    engine: AsyncEngine, store: FlowRunStateStore
) -> None:
    seeded = await seed(engine)
    run = await start_run(store, seeded)
    batched = strategy_for(engine.dialect).multi_statements
    with _round_trips(engine) as trips:
        done = await drive(make_worker(engine, store), seeded.org, run.flow_run_id)
    assert done.state is RunState.SUCCEEDED
    business = [t for t in _transactions(trips) if any(_EVENT in s for r in t for s in r)]
    # bump1 (CreateRecord), bump2 and bump3 (UpdateRecord): one business transaction each.
    assert len(business) == 3
    for txn in business:
        flat = [s for trip in txn for s in trip]
        lock = _index(flat, _LOCK_READ)
        written = _index(flat, _EVENT)
        assert lock < written < _index(flat, _AUDIT) < _index(flat, "INSERT INTO flow_checkpoints")
        cas = [i for i, s in enumerate(flat) if s.startswith(_RECORD_CAS)]
        if strategy_for(engine.dialect).multi_table_update:
            # Record + history in one statement: after the lock read too (the create's
            # record was INSERTed by its lock phase and has no CAS).
            assert all(lock < i for i in cas)
        if batched:
            # One round trip: business writes, checkpoint, final fenced UPDATE.
            [trip] = [r for r in txn if any(_EVENT in s for s in r)]
            assert all(flat[i] in trip for i in cas)
            assert any(s.startswith("INSERT INTO flow_checkpoints") for s in trip)
            # The final fenced UPDATE of root, step and attempt (the attempt named first:
            # it sets a text column, ADR 0015).
            assert any(s.startswith("UPDATE ") and "flow_runs" in s.split(" SET ")[0] for s in trip)
        if batched and cas:
            # An update: the record's lock and the lifecycle locks in one round trip,
            # record first, then that write round trip — two before the COMMIT.
            lock, write = txn
            assert lock[0].startswith("SELECT records.") and _LOCK_READ in lock[1]
            assert write is trip
        if batched and not cas:
            # A create: its record and history INSERTs are its locks, and the lifecycle
            # locking read rides after them in their round trip (ADR 0016), right after
            # the clock's (this first step was claimed by discovery, so its commit then
            # reads the run's last checkpoint sequence).
            clock, insert, *_, write = txn
            assert clock == ["SELECT UTC_TIMESTAMP(6)"]
            assert insert[0].startswith("INSERT INTO records ")
            assert insert[1].startswith("INSERT INTO record_history_sequences ")
            assert _LOCK_READ in insert[2] and len(insert) == 3
            assert write is trip


@pytest.mark.parametrize("moved", ["bump1", "bump2"])
async def test_a_fence_lost_at_the_lifecycle_lock_sends_no_business_write(
    engine: AsyncEngine, store: FlowRunStateStore, moved: str
) -> None:
    """bump2 updates the record (its lock read rides with the record's ``FOR UPDATE``);
    bump1 creates it (the lock read rides after the record's INSERT on MariaDB, which
    the refused fence rolls back with the transaction)."""
    seeded = await seed(engine)
    run = await start_run(store, seeded)
    fired: list[str] = []

    async def hook(at: str, fence: LeaseFence, conn: AsyncConnection | None) -> None:
        if at != "executed" or fired:
            return
        async with db.transaction(engine) as other:
            key = (
                await other.execute(
                    text(
                        "SELECT plan_step_key FROM flow_step_executions "
                        "WHERE org_id = :o AND step_execution_id = :s"
                    ),
                    {"o": seeded.org, "s": fence.step_execution_id},
                )
            ).scalar_one()
            if key != moved:
                return
            fired.append(key)
            # The step moves on after its preparation and before its business
            # transaction (what a lost lease or a concurrent transition leaves): the
            # lifecycle revalidation must refuse the fence.
            await other.execute(
                text(
                    "UPDATE flow_step_executions SET state_version = state_version + 1 "
                    "WHERE org_id = :o AND step_execution_id = :s"
                ),
                {"o": seeded.org, "s": fence.step_execution_id},
            )
        trips.append(["<hook>"])

    worker = make_worker(engine, store, hook=hook)
    with _round_trips(engine) as trips:
        outcomes: list[Outcome] = []
        for _ in range(10):
            batch = await worker.run_batch(seeded.org)
            outcomes.extend(batch)
            if not batch or Outcome.FENCE_LOST in batch:
                break
    assert fired == [moved]
    assert outcomes[-1] is Outcome.FENCE_LOST
    after_hook = trips[trips.index(["<hook>"]) + 1 :]
    refused = after_hook[: after_hook.index([_END])]
    sent = [s for trip in refused for s in trip]
    assert any(_LOCK_READ in s for s in sent)
    assert not any(_EVENT in s or _AUDIT in s for s in sent)
    if strategy_for(engine.dialect).multi_table_update:
        assert not any(s.startswith(_RECORD_CAS) for s in sent)
    counts = await step_counts(engine, seeded.org, run.flow_run_id, moved)
    assert counts.business_events == 0
    if moved == "bump1":
        # The create's INSERTs went out with the lock read and rolled back with it.
        if strategy_for(engine.dialect).multi_statements:
            [trip] = [t for t in refused if any(_LOCK_READ in s for s in t)]
            assert trip[0].startswith("INSERT INTO records ")
        assert await run_records(engine, seeded.org) == []
        assert await count(engine, business_events, org_id=seeded.org) == 0
        return
    # Nothing of bump2 was kept: the record is bump1's, with bump1's event only.
    [record] = await run_records(engine, seeded.org)
    assert record["record_version"] == 1
    assert await count(engine, business_events, org_id=seeded.org) == 1
