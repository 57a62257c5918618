"""§22.3: resolution, expiry and cancellation lock the root first; dependency expiry
racing cancellation has no reverse-order wait — proven on MariaDB by watching the lock
waits InnoDB reports while the transitions queue behind a held root.

A blocker transaction holds the run root ``FOR UPDATE``; two wait transitions start on
their own connections. While they queue, ``information_schema`` must show each of them
waiting for a ``flow_runs`` row lock with that requested row as the only row it locks (so
none of them entered the lifecycle sub-order at the step, dependency or signal). After the blocker
rolls back, exactly one transition wins and the other re-reads the terminal fact.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.kernel import RunState
from runtime_svc.kernel.decisions import CancelRecorded
from runtime_svc.kernel.store_waits import insert_signal_txn
from runtime_svc.kernel.transitions_waits import WaitTransition
from runtime_svc.kernel.wait_model import DependencyState
from runtime_svc.schema import flow_dependencies, flow_runs
from runtime_svc.waits.evidence import validate_submission
from services import db, migrate
from tests.integration.waits.support import World, approval, new_scope, signal_flow

pytestmark = pytest.mark.mariadb

_WAITS_SQL = text(
    """
    SELECT t.trx_id, t.trx_rows_locked, l.lock_table, l.lock_mode
    FROM information_schema.INNODB_LOCK_WAITS w
    JOIN information_schema.INNODB_TRX t ON t.trx_id = w.requesting_trx_id
    JOIN information_schema.INNODB_LOCKS l ON l.lock_id = w.requested_lock_id
    WHERE l.lock_table LIKE :db
    """
)


@pytest.fixture
async def engine(mariadb_url: str) -> AsyncIterator[AsyncEngine]:
    await migrate.upgrade(mariadb_url, "runtime_svc")
    eng = db.create_engine(mariadb_url, pool_size=8)
    try:
        yield eng
    finally:
        await eng.dispose()


async def _due_waiting_run(world: World, key: str) -> tuple[str, str]:
    """A run waiting on a signal whose deadline has passed, with a matching signal."""
    run = await world.start("wait_signal", key=key)
    await world.drive(run.flow_run_id)
    dep = await world.dependency(run.flow_run_id)
    new = validate_submission(approval(key, "t"), world.rt.registry)
    async with db.transaction(world.engine) as conn:
        now = await world.clock(conn)
        await insert_signal_txn(
            conn, world.work, new, now, expires_at=now + timedelta(days=1), match_at=None
        )
    return run.flow_run_id, dep.dependency_id


async def _observed_waits(engine: AsyncEngine, expected: int) -> list[Any]:
    database = engine.url.database
    for _ in range(400):  # bounded: 20 s
        async with engine.connect() as conn:
            rows = (await conn.execute(_WAITS_SQL, {"db": f"`{database}`.%"})).all()
        if len(rows) >= expected:
            return list(rows)
        await asyncio.sleep(0.05)
    raise AssertionError(f"never saw {expected} lock waits (last: {rows})")


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
    engine: AsyncEngine, first: Transition, second: Transition
) -> None:
    world = World(engine, new_scope())
    await world.seed(signal_flow(deadline="PT1H"))
    run_id, dep_id = await _due_waiting_run(world, "race")
    world.clock.advance(hours=4)  # deadline passed, signal received

    blocker = await engine.connect()
    await blocker.begin()
    r = flow_runs.c
    await blocker.execute(
        select(r.flow_run_id)
        .where(r.org_id == world.org, r.flow_run_id == run_id)
        .with_for_update()
    )
    tasks = [
        asyncio.create_task(first(world, run_id, dep_id)),
        asyncio.create_task(second(world, run_id, dep_id)),
    ]
    try:
        waits = await _observed_waits(engine, 2)
    finally:
        await blocker.rollback()
        await blocker.close()
    results = await asyncio.gather(*tasks)

    for _trx, rows_locked, table, _mode in waits:
        assert table.endswith("`flow_runs`"), waits  # the root, never a lower row
        # InnoDB counts the requested root row itself: exactly one row means nothing else
        # (no step, dependency or signal) is held while queued — no reverse-order edge.
        assert rows_locked == 1, waits

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
    engine: AsyncEngine,
) -> None:
    """Control: a deliberately reverse-ordered transaction (dependency, then root) is
    seen holding a second row while it queues on the root — what the test above rules
    out for every wait transition."""
    world = World(engine, new_scope())
    await world.seed(signal_flow(deadline="PT1H"))
    run_id, dep_id = await _due_waiting_run(world, "control")
    d, r = flow_dependencies.c, flow_runs.c

    async def reverse_order() -> None:
        async with db.transaction(engine) as conn:
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

    blocker = await engine.connect()
    await blocker.begin()
    await blocker.execute(
        select(r.flow_run_id)
        .where(r.org_id == world.org, r.flow_run_id == run_id)
        .with_for_update()
    )
    task = asyncio.create_task(reverse_order())
    try:
        [(_trx, rows_locked, table, _mode)] = await _observed_waits(engine, 1)
    finally:
        await blocker.rollback()
        await blocker.close()
    await task
    assert table.endswith("`flow_runs`") and rows_locked == 2
