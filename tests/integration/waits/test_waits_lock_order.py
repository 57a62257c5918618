"""§22.3: resolution, expiry and cancellation lock the root first; dependency expiry
racing cancellation has no reverse-order wait — proven on MariaDB by watching the
transitions while they wait.

A blocker transaction holds the run root ``FOR UPDATE``; two wait transitions start on
their own connections and queue behind it. While they are seen waiting (the server's
process list shows both inside their root ``SELECT … FOR UPDATE``), a probe connection
locks the waiting step, the dependency and the signal with ``FOR UPDATE NOWAIT``: each
probe succeeds at once, so no queued transition holds any lower lifecycle row — none
entered the §12 sub-order below the root, and none can hold a lower row while it waits for
the root (the reverse-order edge a deadlock needs). The control test shows the same probe
failing for a deliberately reverse-ordered transaction. After the blocker rolls back,
exactly one transition wins and the other re-reads the terminal fact.

(InnoDB's ``information_schema`` lock tables are not used: on a server shared by many
sessions their snapshot cache can be truncated, while the process list and a ``NOWAIT``
lock attempt are exact.)
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import select, text
from sqlalchemy.exc import OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.kernel import RunState
from runtime_svc.kernel.decisions import CancelRecorded
from runtime_svc.kernel.store_waits import insert_signal_txn
from runtime_svc.kernel.transitions_waits import WaitTransition
from runtime_svc.kernel.wait_model import DependencyState
from runtime_svc.schema import flow_dependencies, flow_runs, flow_step_executions, flow_wake_signals
from runtime_svc.waits.evidence import validate_submission
from services import db, migrate
from tests.integration.waits.support import World, approval, new_scope, signal_flow

pytestmark = pytest.mark.mariadb

#: MariaDB's answer to a NOWAIT lock that is held (MySQL 8 / TiDB answer 3572).
_LOCKED = (1205, 3572)


@pytest.fixture
async def engine(mariadb_url: str) -> AsyncIterator[AsyncEngine]:
    await migrate.upgrade(mariadb_url, "runtime_svc")
    eng = db.create_engine(mariadb_url, pool_size=8)
    try:
        yield eng
    finally:
        await eng.dispose()


@pytest.fixture
async def world(engine: AsyncEngine) -> World:
    return World(engine, new_scope())


async def _due_waiting_run(world: World, key: str) -> tuple[str, str, str, str]:
    """A run waiting on a signal whose deadline has passed, with a matching unmatched
    signal; returns run, step, dependency and signal ids."""
    run = await world.start("wait_signal", key=key)
    await world.drive(run.flow_run_id)
    dep = await world.dependency(run.flow_run_id)
    new = validate_submission(approval(key, "t"), world.rt.registry)
    async with db.transaction(world.engine) as conn:
        now = await world.clock(conn)
        await insert_signal_txn(
            conn, world.work, new, now, expires_at=now + timedelta(days=1), match_at=None
        )
    return run.flow_run_id, dep.step_execution_id, dep.dependency_id, new.wake_signal_id


async def _hold_root(engine: AsyncEngine, org: str, run_id: str) -> Any:
    blocker = await engine.connect()
    await blocker.begin()
    r = flow_runs.c
    await blocker.execute(
        select(r.flow_run_id).where(r.org_id == org, r.flow_run_id == run_id).with_for_update()
    )
    return blocker


async def _queued_on_the_root(engine: AsyncEngine, expected: int) -> None:
    """Wait (bounded) until ``expected`` sessions of this database are inside a root
    ``SELECT … FOR UPDATE`` (blocked: the blocker holds the row) — a root lock read, or
    a joined lock read whose first table is the root (ADR 0006: ``SELECT STRAIGHT_JOIN
    flow_runs.…``)."""
    database = engine.url.database
    seen: list[Any] = []
    for _ in range(400):  # bounded: 20 s
        async with engine.connect() as conn:
            seen = [
                row
                for row in (await conn.execute(text("SHOW FULL PROCESSLIST"))).all()
                if row[3] == database
                and row[4] == "Query"
                and str(row[7]).startswith(("SELECT flow_runs.", "SELECT STRAIGHT_JOIN flow_runs."))
                and str(row[7]).rstrip().endswith("FOR UPDATE")
            ]
        if len(seen) >= expected:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"never saw {expected} transitions queued on the root (saw {seen})")


async def _lockable_now(engine: AsyncEngine, stmt: Any) -> bool:
    """Whether ``stmt`` (a ``FOR UPDATE NOWAIT`` select) gets its lock at once."""
    async with engine.connect() as conn:
        await conn.begin()
        try:
            await conn.execute(stmt)
        except OperationalError as exc:
            if exc.orig is not None and exc.orig.args and exc.orig.args[0] in _LOCKED:
                return False
            raise
        finally:
            await conn.rollback()
    return True


async def _lower_rows_free(world: World, step_id: str, dep_id: str, signal_id: str) -> bool:
    s, d, w = flow_step_executions.c, flow_dependencies.c, flow_wake_signals.c
    org = world.org
    probes = [
        select(s.step_execution_id)
        .where(s.org_id == org, s.step_execution_id == step_id)
        .with_for_update(nowait=True),
        select(d.dependency_id)
        .where(d.org_id == org, d.dependency_id == dep_id)
        .with_for_update(nowait=True),
        select(w.wake_signal_id)
        .where(w.org_id == org, w.wake_signal_id == signal_id)
        .with_for_update(nowait=True),
    ]
    return all([await _lockable_now(world.engine, p) for p in probes])


Transition = Callable[[World, str, str], Awaitable[Any]]


async def _expire(world: World, run_id: str, dep_id: str) -> Any:
    return await world.rt.matcher.waits.expire(world.org, dep_id)


async def _cancel(world: World, run_id: str, dep_id: str) -> Any:
    return await world.store.request_cancel(world.org, run_id)


async def _resolve(world: World, run_id: str, dep_id: str) -> Any:
    return await world.rt.matcher.reconcile(world.org, dep_id)


@pytest.mark.parametrize(
    ("first", "second"),
    [(_expire, _cancel), (_cancel, _expire), (_resolve, _cancel), (_resolve, _expire)],
    ids=["expiry-vs-cancel", "cancel-vs-expiry", "resolution-vs-cancel", "resolution-vs-expiry"],
)
async def test_wait_transitions_queue_on_the_root_and_hold_no_lower_row_while_waiting(
    world: World, first: Transition, second: Transition
) -> None:
    await world.seed(signal_flow(deadline="PT1H"))
    run_id, step_id, dep_id, signal_id = await _due_waiting_run(world, "race")
    world.clock.advance(hours=4)  # deadline passed, signal received

    blocker = await _hold_root(world.engine, world.org, run_id)
    tasks = [
        asyncio.create_task(first(world, run_id, dep_id)),
        asyncio.create_task(second(world, run_id, dep_id)),
    ]
    try:
        await _queued_on_the_root(world.engine, 2)
        # Both queued on the root; neither holds the step, the dependency or the signal.
        assert await _lower_rows_free(world, step_id, dep_id, signal_id)
        assert not any(t.done() for t in tasks)
    finally:
        await blocker.rollback()
        await blocker.close()
    results = await asyncio.gather(*tasks)

    root = await world.run(run_id)
    dep = await world.dependency(run_id)
    won = [x for x in results if isinstance(x, WaitTransition | CancelRecorded)]
    if _cancel in (first, second) and any(
        isinstance(x, WaitTransition) and x.outcome == "resolved" for x in won
    ):
        # A resolution that won leaves a Runnable run, which a cancellation may then
        # legitimately cancel: both commit, one after the other, root first.
        assert len(won) == 2 and root.state is RunState.CANCEL_REQUESTED
        assert dep.state is DependencyState.RESOLVED
        return
    assert len(won) == 1, results  # exactly one winner; the other re-read the fact
    if isinstance(won[0], CancelRecorded):
        assert root.state is RunState.CANCEL_REQUESTED
        assert dep.state is DependencyState.CANCELLED
    elif won[0].outcome == "resolved":
        assert root.state is RunState.RUNNABLE and dep.state is DependencyState.RESOLVED
    else:
        assert root.state is RunState.TERMINAL_FAILED and dep.state is DependencyState.EXPIRED


async def test_the_observation_detects_a_transaction_that_enters_at_the_dependency(
    world: World,
) -> None:
    """Control: a deliberately reverse-ordered transaction (dependency, then root) is
    seen holding the dependency while it queues on the root — what the test above rules
    out for every wait transition."""
    await world.seed(signal_flow(deadline="PT1H"))
    run_id, step_id, dep_id, signal_id = await _due_waiting_run(world, "control")
    d, r = flow_dependencies.c, flow_runs.c

    async def reverse_order() -> None:
        async with db.transaction(world.engine) as conn:
            await conn.execute(
                select(d.dependency_id)
                .where(d.org_id == world.org, d.dependency_id == dep_id)
                .with_for_update()
            )
            await conn.execute(
                select(r.flow_run_id)
                .where(r.org_id == world.org, r.flow_run_id == run_id)
                .with_for_update()
            )

    blocker = await _hold_root(world.engine, world.org, run_id)
    task = asyncio.create_task(reverse_order())
    try:
        await _queued_on_the_root(world.engine, 1)
        assert not await _lower_rows_free(world, step_id, dep_id, signal_id)
    finally:
        await blocker.rollback()
        await blocker.close()
    await task
