"""§14.2 step 4 reconciliation in one snapshot (round 6, issue 12): ``Matcher.reconcile``
reads the dependency and its producer's evidence in ONE read-only transaction (it used
two: the dependency, then the probe's evidence), then resolves root-first in its own
transaction; a dependency no longer pending reads no evidence. SQLite and MariaDB."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

import runtime_svc.waits.resolution as resolution
from runtime_svc.kernel.decisions import NoChange
from runtime_svc.kernel.store_waits import insert_signal_txn
from runtime_svc.kernel.transitions_waits import WaitTransition
from runtime_svc.kernel.wait_model import DependencyState
from runtime_svc.waits.evidence import validate_submission
from services import db
from tests.integration.waits.support import World, approval, signal_flow
from tests.support.statements import watched_statements


def _counting(monkeypatch: pytest.MonkeyPatch, module: Any = resolution) -> list[bool]:
    """The transactions ``module`` opens (their ``readonly``)."""
    opened: list[bool] = []
    original = module.transaction

    @asynccontextmanager
    async def counted(engine: AsyncEngine, *, readonly: bool = False) -> AsyncIterator[Any]:
        opened.append(readonly)
        async with original(engine, readonly=readonly) as conn:
            yield conn

    monkeypatch.setattr(module, "transaction", counted)
    return opened


async def test_reconcile_reads_dependency_and_evidence_in_one_transaction(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    await world.seed(signal_flow(deadline="PT1H"))
    run = await world.start("wait_signal", key="snap")
    await world.drive(run.flow_run_id)
    dep = await world.dependency(run.flow_run_id)
    new = validate_submission(approval("snap", "t"), world.rt.registry)
    async with db.transaction(world.engine) as conn:  # a signal nobody matched yet
        now = await world.clock(conn)
        await insert_signal_txn(
            conn, world.work, new, now, expires_at=now + timedelta(days=1), match_at=None
        )
    opened = _counting(monkeypatch)
    result = await world.rt.matcher.reconcile(world.org, dep.dependency_id)
    assert isinstance(result, WaitTransition)
    assert opened == [True]  # one read-only snapshot; the resolution is the kernel's
    assert (await world.dependency(run.flow_run_id)).state is DependencyState.RESOLVED
    # Resolved now: the dependency is read, no evidence, no resolution.
    opened.clear()
    again = await world.rt.matcher.reconcile(world.org, dep.dependency_id)
    assert isinstance(again, NoChange) and again.reason == "dependency_resolved"
    assert opened == [True]
    missing = await world.rt.matcher.reconcile(world.org, "no-such-dependency")
    assert isinstance(missing, NoChange) and missing.reason == "missing"


async def test_reconcile_of_a_signal_wait_nothing_notified_reads_two_rows_only(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Right after a signal wait commits, nothing has notified it (the common case; an
    effect's completion cannot have a receipt yet): the fresh reconciliation reads the
    dependency and the key's unmatched signals — not the run, its plan step and bounds —
    and answers ``no_signal``. A signal that arrives later is still matched by it."""
    await world.seed(signal_flow(deadline="PT1H"))
    run = await world.start("wait_signal", key="quiet")
    await world.drive(run.flow_run_id)
    dep = await world.dependency(run.flow_run_id)
    opened = _counting(monkeypatch)
    with watched_statements(world.engine) as seen:
        result = await world.rt.matcher.reconcile(world.org, dep.dependency_id)
    # SQLite's own BEGIN aside, the verb of each statement.
    statements = [s.split()[0].upper() for s in seen if not s.startswith("BEGIN")]
    assert isinstance(result, NoChange) and result.reason == "no_signal"
    assert opened == [True]
    assert statements == ["SELECT", "SELECT"]  # the dependency, the key's signals
    new = validate_submission(approval("quiet", "t"), world.rt.registry)
    async with db.transaction(world.engine) as conn:
        now = await world.clock(conn)
        await insert_signal_txn(
            conn, world.work, new, now, expires_at=now + timedelta(days=1), match_at=None
        )
    assert isinstance(
        await world.rt.matcher.reconcile(world.org, dep.dependency_id), WaitTransition
    )
    assert (await world.dependency(run.flow_run_id)).state is DependencyState.RESOLVED


async def test_a_sweep_pass_reads_its_clock_inside_each_parts_transaction(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Round 6: each part of a wait-sweep pass (probes, owed matches, deadlines, repair,
    retention) reads the database clock in its own query's transaction; a pass over an
    org with a waiting run and nothing due opens one transaction per part (it opened
    four more, clock-only ones, every pass and org)."""
    import runtime_svc.waits.reconciler as reconciler

    await world.seed(signal_flow(deadline="PT1H"))
    run = await world.start("wait_signal", key="idle")
    await world.drive(run.flow_run_id)
    opened = _counting(monkeypatch, reconciler)
    stats = await world.sweep()
    assert stats.probes == 0 and stats.expired == 0 and stats.resolved == 0
    # probes, owed, deadlines, repair (read-only); retention; the first pass of a
    # sweeper also looks for idle watch registrations (read-only)
    assert opened == [True, True, True, True, False, True]
    assert (await world.dependency(run.flow_run_id)).state is DependencyState.PENDING
