"""The producer-side fused match decides on its own unlocked reads of the dependency and
the signal (``runtime_svc.waits.resolution.Matcher._match_accepted``, ``HeldRun``): their
conditional UPDATEs are the fence. These tests pin that it reads each of them once, and
that a row which moved after that read rolls the whole transaction back — root and step
included — and the locking two-transaction match resolves the wait exactly once.
Both backends (the ``world`` fixture)."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import event, select

from runtime_svc.api.signals import encode_submit_response
from runtime_svc.kernel import RunState
from runtime_svc.kernel.wait_model import DependencyState, SignalState
from runtime_svc.schema import flow_dependencies, flow_runs
from runtime_svc.waits import queries
from services import db
from services.db import strategy_for
from services.db_batch import statements_of
from services.proto import runtime_v1
from services.request_dedupe import DedupeScope, RequestKey
from tests.integration.waits.support import (
    World,
    approval,
    dependencies,
    events_of,
    signal_flow,
    signals,
    task_subjects,
)
from tests.support.statements import clock_reads, watched_statements


async def _waiting(world: World) -> str:
    await world.seed(signal_flow())
    run = await world.start("wait_signal", key="r1")
    assert (await world.drive(run.flow_run_id)).state is RunState.WAITING
    return run.flow_run_id


async def _versions(world: World, run_id: str) -> tuple[int, int]:
    async with world.engine.connect() as conn:
        root = (
            await conn.execute(
                select(flow_runs.c.state_version).where(
                    flow_runs.c.org_id == world.org, flow_runs.c.flow_run_id == run_id
                )
            )
        ).scalar_one()
        dep = (
            await conn.execute(
                select(flow_dependencies.c.state_version).where(
                    flow_dependencies.c.org_id == world.org,
                    flow_dependencies.c.flow_run_id == run_id,
                )
            )
        ).scalar_one()
    return int(root), int(dep)


async def test_the_fused_match_reads_the_dependency_and_the_signal_once(world: World) -> None:
    run_id = await _waiting(world)
    with watched_statements(world.engine) as seen:
        outcome = await world.rt.signals.submit(world.work, approval("r1", "t1"))
    reads: dict[str, int] = {"flow_dependencies": 0, "flow_wake_signals": 0}
    for statement in seen:
        if statement.startswith("SELECT") and " FROM " in statement:
            head = statement.split(" FROM ", 1)[1].split(" ", 1)[0]
            if head in reads:
                reads[head] += 1
    assert outcome.signal.state is SignalState.CONSUMED
    # Acceptance: no token lookup (the insert is the duplicate check); match: the key's
    # pending dependencies and the key's unmatched signals — nothing locked and read
    # again before the UPDATEs.
    assert reads == {"flow_dependencies": 1, "flow_wake_signals": 1}
    assert (await world.dependency(run_id)).state is DependencyState.RESOLVED
    assert (await world.drive(run_id)).state is RunState.SUCCEEDED


def _stale_once(
    original: Callable[..., Awaitable[list[Any]]], calls: list[int]
) -> Callable[..., Awaitable[list[Any]]]:
    """``original`` whose first answer carries rows one version behind the database (a
    row that moved after the read); later calls answer the truth."""

    async def stale(*args: Any, **kwargs: Any) -> list[Any]:
        rows = await original(*args, **kwargs)
        calls.append(len(rows))
        if len(calls) == 1:
            return [dataclasses.replace(r, state_version=r.state_version - 1) for r in rows]
        return rows

    return stale


@pytest.mark.parametrize("moved", ["dependency", "signal"])
async def test_a_row_that_moved_after_the_read_rolls_back_and_the_locking_match_resolves_once(
    world: World, monkeypatch: pytest.MonkeyPatch, moved: str
) -> None:
    run_id = await _waiting(world)
    root_before, dep_before = await _versions(world, run_id)
    calls: list[int] = []
    name = "pending_for_key_txn" if moved == "dependency" else "unmatched_for_key_txn"
    monkeypatch.setattr(queries, name, _stale_once(getattr(queries, name), calls))
    resolved: list[object] = []
    waits = world.rt.matcher.waits
    locking = waits.resolve

    async def counted(*args: Any, **kwargs: Any) -> Any:
        result = await locking(*args, **kwargs)
        resolved.append(result)
        return result

    monkeypatch.setattr(waits, "resolve", counted)
    outcome = await world.rt.signals.submit(world.work, approval("r1", "t1"))
    # The fused transaction read a stale row, its compare-and-swap failed and it rolled
    # back; the two-transaction match re-read, locked and resolved.
    assert len(calls) >= 2
    assert len(resolved) == 1
    assert outcome.signal.state is SignalState.CONSUMED
    dep = await world.dependency(run_id)
    assert dep.state is DependencyState.RESOLVED
    assert dep.wake_signal_id == outcome.signal.wake_signal_id
    # One resolution's worth of version bumps: the rolled-back UPDATEs left nothing.
    assert await _versions(world, run_id) == (root_before + 1, dep_before + 1)
    [signal] = await signals(world.engine, world.org)
    assert signal.state is SignalState.CONSUMED and signal.next_match_at is None
    assert (await world.drive(run_id)).state is RunState.SUCCEEDED
    assert await task_subjects(world.engine, world.org) == ["resumed"]
    assert await events_of(world.engine, world.org, run_id) == 1


async def test_a_deduplicated_submission_reads_the_clock_with_its_ledger_lookup(
    world: World,
) -> None:
    """``SubmitWakeSignal``'s acceptance takes its clock from the request-ledger lookup
    and the match from its root+step lock (``lock_run_and_step``): neither reads the
    clock with a statement of its own."""
    run_id = await _waiting(world)
    submission = approval("r1", "t1")
    request = runtime_v1.SubmitWakeSignalRequest(
        request_id="req-clock",
        producer_kind=submission.producer_kind,
        producer_key=submission.producer_key,
        wake_token=submission.wake_token,
    )
    key = RequestKey.of(DedupeScope.of_work_scope(world.work), "SubmitWakeSignal", request)
    world.clock.advance(seconds=30)  # a shifted clock keeps its offset on this path
    with watched_statements(world.engine) as seen:
        data = await world.rt.signals.submit_once(
            world.work, submission, key, encode_submit_response
        )
    answer = runtime_v1.SubmitWakeSignalResponse.FromString(data)
    assert answer.signal.resolution_state == int(SignalState.CONSUMED)
    # The acceptance's clock came with the ledger lookup, the match's with its lock read.
    assert clock_reads(world.engine, seen) == []
    [signal] = await signals(world.engine, world.org)
    async with world.engine.connect() as conn:
        now = await db.db_now(conn)
    assert signal.received_at > now + timedelta(seconds=20)  # the shifted clock's time
    [dep] = await dependencies(world.engine, world.org, run_id)
    assert dep.resolved_at is not None and dep.resolved_at > now + timedelta(seconds=20)
    assert (await world.drive(run_id)).state is RunState.SUCCEEDED


async def test_the_resolution_writes_root_step_and_dependency_in_one_round_trip(
    world: World,
) -> None:
    """Root and step are held by the match's lock read, so their UPDATE and the
    dependency's conditional UPDATE go out together where the backend batches writes,
    the dependency's last (ADR 0010: its fence may be the one that takes its lock); the
    signal's UPDATE stays after that check. One by one on SQLite."""
    run_id = await _waiting(world)
    trips: list[list[str]] = []  # per round trip, its statements (whitespace collapsed)

    def on_execute(*args: Any) -> None:
        trips.append([" ".join(part.split()) for part in statements_of(str(args[2]))])

    sync = world.engine.sync_engine
    event.listen(sync, "before_cursor_execute", on_execute)
    try:
        outcome = await world.rt.signals.submit(world.work, approval("r1", "t1"))
    finally:
        event.remove(sync, "before_cursor_execute", on_execute)
    assert outcome.signal.state is SignalState.CONSUMED
    [parts] = [t for t in trips if any(s.startswith("UPDATE flow_dependencies") for s in t)]
    [signal_trip] = [t for t in trips if any(s.startswith("UPDATE flow_wake_signals") for s in t)]
    if strategy_for(world.engine.dialect).multi_statements:
        assert len(parts) == 2  # root + step (one multi-table UPDATE), then the dependency
        assert parts[0].startswith("UPDATE flow_runs, flow_step_executions")
        assert parts[1].startswith("UPDATE flow_dependencies")
    else:
        assert len(parts) == 1
    assert len(signal_trip) == 1
    assert (await world.dependency(run_id)).state is DependencyState.RESOLVED
    assert (await world.drive(run_id)).state is RunState.SUCCEEDED
