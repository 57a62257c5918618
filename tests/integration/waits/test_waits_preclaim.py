"""The pre-claimed wake (``docs/adr/0007-pre-claimed-wake.md``) on SQLite and MariaDB: a
resolution in a process whose worker has room claims the resumed step Running for it
in the resolution's own transaction; the worker executes it once and the run finishes.
A process with no such worker, no room, or a refusing admission takes the hinted path
(step Pending, root Runnable, no attempt); cancellation and delete racing a pre-claimed
step fence its commit; a handover nobody executes is recovered by lease expiry once;
duplicate and stale signals stay no-ops."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from sqlalchemy import event, select
from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.admission.budgets import AdmissionPolicy
from runtime_svc.admission.controller import AdmissionController
from runtime_svc.kernel import RunState
from runtime_svc.kernel.store_operator import OperatorActor, pause_run_txn, resume_run_txn
from runtime_svc.kernel.wait_model import DependencyState, SignalState
from runtime_svc.schema import flow_step_attempts, flow_step_executions
from runtime_svc.waits import queries
from runtime_svc.waits.preclaim import PreClaimedWake, PreClaimer
from runtime_svc.waits.resolution import ResolvedRun
from runtime_svc.worker import FixedViews, Outcome, StepWorker
from runtime_svc.worker.background import LocalWakeSeats
from services import db
from services.db_batch import statements_of
from tests.integration.waits.support import (
    World,
    approval,
    dependencies,
    events_of,
    signal_flow,
    signals,
    task_subjects,
)
from tests.integration.worker.support import record_view


@contextmanager
def round_trips(engine: AsyncEngine) -> Iterator[list[list[str]]]:
    """Per round trip ``engine`` sends inside the block, its statements (collapsed)."""
    trips: list[list[str]] = []

    def on_execute(*args: Any) -> None:
        trips.append([" ".join(p.split()) for p in statements_of(str(args[2]))])

    event.listen(engine.sync_engine, "before_cursor_execute", on_execute)
    try:
        yield trips
    finally:
        event.remove(engine.sync_engine, "before_cursor_execute", on_execute)


def _table_of(statement: str) -> str:
    """``UPDATE <table>`` / ``INSERT INTO <table>`` of a collapsed statement."""
    words = statement.replace(",", " ").split()
    return " ".join(words[:3] if words[0] == "INSERT" else words[:2])


def _preclaiming(world: World, seats: LocalWakeSeats) -> None:
    """Wire ``world`` as a runtime process with a local worker does."""
    world.rt.matcher.preclaim = PreClaimer(world.store, seats)


async def _waiting(world: World, key: str) -> str:
    if "wait_signal" not in world.plans:
        await world.seed(signal_flow())
    run = await world.start("wait_signal", key=key)
    parked = await world.drive(run.flow_run_id)  # also caches the plan in the worker
    assert parked.state is RunState.WAITING
    return run.flow_run_id


async def _resumed_step(engine: AsyncEngine, org: str, run_id: str) -> dict[str, Any]:
    s = flow_step_executions.c
    async with db.transaction(engine, readonly=True) as conn:
        rows = (
            await conn.execute(
                select(flow_step_executions).where(
                    s.org_id == org, s.flow_run_id == run_id, s.plan_step_key == "pause"
                )
            )
        ).mappings()
        return dict(next(iter(rows)))


async def _attempts(engine: AsyncEngine, org: str, step_id: str) -> list[str]:
    a = flow_step_attempts.c
    async with db.transaction(engine, readonly=True) as conn:
        rows = await conn.execute(
            select(a.transaction_outcome)
            .where(a.org_id == org, a.step_execution_id == step_id)
            .order_by(a.attempt_number)
        )
        return [str(r) for r in rows.scalars()]


def _taken(seats: LocalWakeSeats) -> PreClaimedWake:
    item = seats.take()
    assert item is not None, "nothing was handed over"
    assert seats.take() is None
    return item[0]


async def test_a_preclaimed_wake_runs_the_step_once_and_the_run_finishes(world: World) -> None:
    run_id = await _waiting(world, "pc1")
    before = await _resumed_step(world.engine, world.org, run_id)
    hints: list[object] = []
    seats = LocalWakeSeats([world.worker])
    _preclaiming(world, seats)
    world.rt.matcher._on_resolved = hints.append  # the hinted path would publish here
    with round_trips(world.engine) as trips:
        await world.rt.signals.submit(world.work, approval("pc1", "t1"))
    # The resolution's root/step and dependency UPDATEs open the claim's round trip and
    # the signal's UPDATE closes it (ADR 0010's addenda): one round trip of writes.
    [claim_trip] = [t for t in trips if any(x.startswith("INSERT INTO flow_step_att") for x in t)]
    [signal_trip] = [t for t in trips if any(x.startswith("UPDATE flow_wake_signals") for x in t)]
    dependency_trips = [t for t in trips if any(x.startswith("UPDATE flow_dep") for x in t)]
    if db.strategy_for(world.engine.dialect).multi_statements:
        assert signal_trip is claim_trip and dependency_trips == [claim_trip]
        assert [_table_of(x) for x in claim_trip] == [
            "UPDATE flow_runs",  # the resolution: root and step, one statement
            "UPDATE flow_dependencies",
            "UPDATE flow_runs",  # the claim: root and step Running, one statement
            "INSERT INTO flow_step_attempts",
            "UPDATE flow_wake_signals",
        ]
    else:
        assert len(signal_trip) == 1 and len(dependency_trips) == 1
    # The resolution committed with the claim: the step is Running (a new attempt, the
    # seat's lease owner), the root Running on it — nothing left for anyone to claim.
    assert (await world.run(run_id)).state is RunState.RUNNING
    step = await _resumed_step(world.engine, world.org, run_id)
    assert step["state"] == "Running" and step["lease_owner"] == seats.owner
    assert step["attempt_count"] == before["attempt_count"] + 1
    assert hints == []  # handed over, not hinted
    assert (await world.worker.run_batch(world.org)) == []  # no claimable candidate
    wake = _taken(seats)
    assert wake.fence.step_execution_id == step["step_execution_id"]
    assert seats.outstanding() == 0
    # The resumed wait step, then its successor by continuation (ADR 0002).
    assert await world.worker.process_preclaimed(wake) == [Outcome.COMMITTED] * 2
    assert (await world.run(run_id)).state is RunState.SUCCEEDED
    assert await task_subjects(world.engine, world.org) == ["resumed"]
    assert await events_of(world.engine, world.org, run_id) == 1
    [dep] = await dependencies(world.engine, world.org, run_id)
    assert dep.state is DependencyState.RESOLVED
    [signal] = await signals(world.engine, world.org)
    assert signal.state is SignalState.CONSUMED
    # A duplicate of the consumed signal is a no-op: nothing is claimed or handed over.
    await world.rt.signals.submit(world.work, approval("pc1", "t1"))
    assert seats.take() is None and seats.outstanding() == 0
    assert await events_of(world.engine, world.org, run_id) == 1


async def test_no_local_worker_for_the_lane_takes_todays_path(world: World) -> None:
    run_id = await _waiting(world, "nolane")
    other = StepWorker(
        world.engine,
        world.store,
        FixedViews(record_view()),
        owner="mutations-only",
        queue_classes=("durable_mutation",),
        heartbeat=False,
    )
    seats = LocalWakeSeats([other])
    _preclaiming(world, seats)
    hints: list[ResolvedRun] = []
    world.rt.matcher._on_resolved = hints.append
    before = await _resumed_step(world.engine, world.org, run_id)
    await world.rt.signals.submit(world.work, approval("nolane", "t1"))
    assert (await world.run(run_id)).state is RunState.RUNNABLE
    step = await _resumed_step(world.engine, world.org, run_id)
    assert step["state"] == "Pending" and step["attempt_count"] == before["attempt_count"]
    assert [h.flow_run_id for h in hints] == [run_id] and seats.outstanding() == 0


async def test_no_room_takes_todays_path(world: World) -> None:
    first = await _waiting(world, "room1")
    second = await _waiting(world, "room2")
    seats = LocalWakeSeats([world.worker])  # one worker: room for one handover
    _preclaiming(world, seats)
    hints: list[ResolvedRun] = []
    world.rt.matcher._on_resolved = hints.append
    await world.rt.signals.submit(world.work, approval("room1", "t1"))
    assert (await world.run(first)).state is RunState.RUNNING
    before = await _resumed_step(world.engine, world.org, second)
    await world.rt.signals.submit(world.work, approval("room2", "t1"))
    # The first handover is not taken yet: no room for the second wake.
    assert (await world.run(second)).state is RunState.RUNNABLE
    step = await _resumed_step(world.engine, world.org, second)
    assert step["state"] == "Pending" and step["attempt_count"] == before["attempt_count"]
    assert [h.flow_run_id for h in hints] == [second]
    # Nothing claimed: the resolution's signal UPDATE was written on its own, once.
    assert {x.state for x in await signals(world.engine, world.org)} == {SignalState.CONSUMED}
    assert await world.worker.process_preclaimed(_taken(seats)) == [Outcome.COMMITTED] * 2
    assert (await world.drive(second)).state is RunState.SUCCEEDED
    assert (await world.run(first)).state is RunState.SUCCEEDED
    assert await events_of(world.engine, world.org, first) == 1
    assert await events_of(world.engine, world.org, second) == 1


async def test_a_refusing_admission_takes_todays_path(world: World) -> None:
    run_id = await _waiting(world, "adm")

    async def policies(org_id: str) -> AdmissionPolicy:
        return AdmissionPolicy()

    admission = AdmissionController(world.engine, budget=4, policies=policies)
    # No admission decision was cached for the org (its policy unread, no credit):
    # deciding would need I/O inside the resolution, so the pre-claim is refused.
    seats = LocalWakeSeats([world.worker], admission=admission)
    _preclaiming(world, seats)
    hints: list[ResolvedRun] = []
    world.rt.matcher._on_resolved = hints.append
    before = await _resumed_step(world.engine, world.org, run_id)
    await world.rt.signals.submit(world.work, approval("adm", "t1"))
    assert (await world.run(run_id)).state is RunState.RUNNABLE
    step = await _resumed_step(world.engine, world.org, run_id)
    assert step["state"] == "Pending" and step["attempt_count"] == before["attempt_count"]
    assert [h.flow_run_id for h in hints] == [run_id]
    assert admission.inflight() == 0 and seats.outstanding() == 0


async def test_an_admitting_admission_preclaims_and_releases_its_ticket(world: World) -> None:
    run_id = await _waiting(world, "adm2")

    async def policies(org_id: str) -> AdmissionPolicy:
        return AdmissionPolicy()

    admission = AdmissionController(world.engine, budget=4, policies=policies)
    await admission.lanes(world.org, ("dependency_wakeup",), 4)  # a visit: policy + credit
    seats = LocalWakeSeats([world.worker], admission=admission)
    _preclaiming(world, seats)
    await world.rt.signals.submit(world.work, approval("adm2", "t1"))
    assert (await world.run(run_id)).state is RunState.RUNNING
    assert admission.inflight() == 1  # the reservation's ticket covers the step
    item = seats.take()
    assert item is not None and item[1] is not None
    outcomes = await world.worker.process_preclaimed(item[0], admission=admission, ticket=item[1])
    assert outcomes == [Outcome.COMMITTED] * 2
    assert admission.inflight() == 0
    assert (await world.run(run_id)).state is RunState.SUCCEEDED


async def _race(world: World, key: str, action: str) -> tuple[str, list[Outcome]]:
    run_id = await _waiting(world, key)
    seats = LocalWakeSeats([world.worker])
    _preclaiming(world, seats)
    await world.rt.signals.submit(world.work, approval(key, "t1"))
    assert (await world.run(run_id)).state is RunState.RUNNING
    wake = _taken(seats)
    if action == "cancel":
        await world.store.request_cancel(world.org, run_id)
    else:
        await world.store.delete_run(world.org, run_id)
    return run_id, await world.worker.process_preclaimed(wake)


async def test_cancellation_racing_a_preclaimed_step_fences_its_commit(world: World) -> None:
    run_id, outcomes = await _race(world, "pcc", "cancel")
    assert outcomes == [Outcome.FENCE_LOST]
    assert await task_subjects(world.engine, world.org) == []
    assert await events_of(world.engine, world.org, run_id) == 0
    await world.lease_sweeper.sweep_org(world.org)
    assert (await world.run(run_id)).state is RunState.CANCELLED


async def test_delete_racing_a_preclaimed_step_fences_its_commit(world: World) -> None:
    run_id, outcomes = await _race(world, "pcd", "delete")
    assert outcomes == [Outcome.FENCE_LOST]
    assert await events_of(world.engine, world.org, run_id) == 0
    await world.lease_sweeper.sweep_org(world.org)
    final = await world.run(run_id)
    assert final.state is RunState.CANCELLED and final.is_deleted


async def test_a_preclaimed_step_never_executed_is_recovered_by_lease_expiry_once(
    world: World,
) -> None:
    run_id = await _waiting(world, "lost")
    seats = LocalWakeSeats([world.worker])
    _preclaiming(world, seats)
    await world.rt.signals.submit(world.work, approval("lost", "t1"))
    step = await _resumed_step(world.engine, world.org, run_id)
    assert step["state"] == "Running"
    # The worker dies with the handover undelivered (the process is gone): nothing
    # renews the lease, nobody else may claim the Running step meanwhile.
    assert seats.take() is not None
    world.rt.matcher.preclaim = None
    assert (await world.worker.run_batch(world.org)) == []
    assert (await world.lease_sweeper.sweep_org(world.org))[0] == 0  # the lease is live
    world.clock.advance(seconds=world.store.policy.lease_duration_ms / 1000 + 1)
    assert (await world.lease_sweeper.sweep_org(world.org))[0] == 1  # expiry fences it
    world.clock.advance(hours=2)  # past the recovery backoff floor
    assert (await world.drive(run_id)).state is RunState.SUCCEEDED
    assert await task_subjects(world.engine, world.org) == ["resumed"]
    assert await events_of(world.engine, world.org, run_id) == 1
    attempts = await _attempts(world.engine, world.org, step["step_execution_id"])
    assert attempts.count("Committed") == 2 and attempts.count("Fenced") == 1, attempts


async def test_a_paused_run_is_resolved_but_not_preclaimed(world: World) -> None:
    run_id = await _waiting(world, "paused")
    async with db.transaction(world.engine) as conn:
        await pause_run_txn(conn, world.org, run_id, OperatorActor("ops-test"))
    seats = LocalWakeSeats([world.worker])
    _preclaiming(world, seats)
    before = await _resumed_step(world.engine, world.org, run_id)
    await world.rt.signals.submit(world.work, approval("paused", "t1"))
    # The claim decision refuses a paused root: the resolution commits alone.
    run = await world.run(run_id)
    assert run.state is RunState.RUNNABLE and run.operator_paused_at is not None
    step = await _resumed_step(world.engine, world.org, run_id)
    assert step["state"] == "Pending" and step["attempt_count"] == before["attempt_count"]
    assert seats.take() is None and seats.outstanding() == 0
    [dep] = await dependencies(world.engine, world.org, run_id)
    assert dep.state is DependencyState.RESOLVED
    [signal] = await signals(world.engine, world.org)  # refused claim: written alone
    assert signal.state is SignalState.CONSUMED and signal.dependency_id == dep.dependency_id
    async with db.transaction(world.engine) as conn:
        await resume_run_txn(conn, world.org, run_id, OperatorActor("ops-test"))
    assert (await world.drive(run_id)).state is RunState.SUCCEEDED
    assert await events_of(world.engine, world.org, run_id) == 1


async def test_a_runtime_process_with_a_worker_preclaims_its_wakes(world: World) -> None:
    """``start_background`` wires the pre-claimed wake: the process's own worker parks
    the run (so it holds its plan and the org's admission state), the signal's
    resolution claims the resumed step for it, and the worker loop runs the hand-over
    to the end — from the hand-over, not from a hint or a poll."""
    from runtime_svc.worker import WorkerSettings, start_background
    from services.background import Wakeup
    from tests.support.procs import assert_eventually

    if "wait_signal" not in world.plans:
        await world.seed(signal_flow())
    run = await world.start("wait_signal", key="bg")
    taken: list[PreClaimedWake] = []
    real = StepWorker.process_preclaimed

    async def counted(self: StepWorker, wake: PreClaimedWake, **kw: Any) -> list[Outcome]:
        taken.append(wake)
        return await real(self, wake, **kw)

    wake = Wakeup()
    world.rt.matcher._on_resolved = wake.notify
    settings = WorkerSettings(workers=1, sweeps=False, idle_ms=200)
    StepWorker.process_preclaimed = counted  # type: ignore[method-assign]
    bg = await start_background(
        None,
        world.engine,
        views=FixedViews(record_view()),
        settings=settings,
        waits=world.rt,
        work_wake=wake,
    )
    try:

        async def state_is(state: RunState) -> bool:
            return (await world.run(run.flow_run_id)).state is state

        await assert_eventually(lambda: state_is(RunState.WAITING), timeout=30, what="waiting")
        await world.rt.signals.submit(world.work, approval("bg", "t1"))
        await assert_eventually(lambda: state_is(RunState.SUCCEEDED), timeout=60, what="done")
    finally:
        await bg.stop()
        StepWorker.process_preclaimed = real  # type: ignore[method-assign]
        world.rt.matcher.preclaim = None
    assert [w.fence.flow_run_id for w in taken] == [run.flow_run_id]
    assert await events_of(world.engine, world.org, run.flow_run_id) == 1


async def test_a_dependency_that_moved_rolls_the_fused_resolution_and_claim_back_together(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The resolution's dependency UPDATE is checked inside the claim's round trip: when
    the dependency moved after the fused match read it, that UPDATE matches no row, the
    claim's writes sent after it roll back with it (no attempt, no lease, the seat given
    back) and the locking two-transaction match resolves and pre-claims the wake once."""
    run_id = await _waiting(world, "moved1")
    before = await _resumed_step(world.engine, world.org, run_id)
    seats = LocalWakeSeats([world.worker])
    _preclaiming(world, seats)
    calls: list[int] = []
    original = queries.pending_for_key_txn

    async def stale(*args: Any, **kwargs: Any) -> list[Any]:
        rows = await original(*args, **kwargs)
        calls.append(len(rows))
        if len(calls) == 1:  # the fused match's read: one version behind the row
            return [dataclasses.replace(r, state_version=r.state_version - 1) for r in rows]
        return rows

    monkeypatch.setattr(queries, "pending_for_key_txn", stale)
    with round_trips(world.engine) as trips:
        await world.rt.signals.submit(world.work, approval("moved1", "t1"))
    claim_trips = [t for t in trips if any(x.startswith("INSERT INTO flow_step_att") for x in t)]
    if db.strategy_for(world.engine.dialect).multi_statements:
        # The fused attempt sent its claim with the stale dependency UPDATE, and rolled back;
        # the locking match claimed again.
        assert len(claim_trips) == 2
    # One claim survived: one new attempt, the step Running for the seat, one handover.
    step = await _resumed_step(world.engine, world.org, run_id)
    assert step["state"] == "Running" and step["lease_owner"] == seats.owner
    assert step["attempt_count"] == before["attempt_count"] + 1
    attempts = await _attempts(world.engine, world.org, step["step_execution_id"])
    assert len(attempts) == step["attempt_count"]
    wake = _taken(seats)
    assert seats.outstanding() == 0
    [dep] = await dependencies(world.engine, world.org, run_id)
    assert dep.state is DependencyState.RESOLVED
    assert await world.worker.process_preclaimed(wake) == [Outcome.COMMITTED] * 2
    assert (await world.run(run_id)).state is RunState.SUCCEEDED
    assert await events_of(world.engine, world.org, run_id) == 1
