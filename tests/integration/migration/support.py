"""Helpers of the migration tests: V2 runs next to legacy ones, raw row reads, and a
statement recorder proving what an INSERT wrote explicitly."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import event, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.kernel import CheckpointInput, EnterWait, FlowRunStateStore, LeaseFence
from runtime_svc.schema import flow_runs
from services import db
from services.auth import TrustedRuntimeWorkScope
from tests.integration.kernel.conftest import TEST_POLICY, ShiftedClock, seed_plan
from tests.integration.kernel.conftest import World as KernelWorld
from tests.integration.kernel.helpers import QUEUE, start

__all__ = [
    "capture_inserts",
    "raw_run",
    "tamper",
    "v2_waiting_run",
    "v2_world",
]


async def raw_run(engine: AsyncEngine, org_id: str, run_id: str) -> dict[str, Any]:
    async with db.transaction(engine, readonly=True) as conn:
        row = (
            (
                await conn.execute(
                    select(flow_runs).where(
                        flow_runs.c.org_id == org_id, flow_runs.c.flow_run_id == run_id
                    )
                )
            )
            .mappings()
            .one()
        )
        return dict(row)


async def tamper(engine: AsyncEngine, org_id: str, run_id: str, **values: Any) -> None:
    """Change a row behind every store's back (simulating a corrupt/foreign writer)."""
    async with db.transaction(engine) as conn:
        await conn.execute(
            update(flow_runs)
            .where(flow_runs.c.org_id == org_id, flow_runs.c.flow_run_id == run_id)
            .values(**values)
        )


async def v2_world(
    engine: AsyncEngine, scope: TrustedRuntimeWorkScope, clock: ShiftedClock
) -> KernelWorld:
    """A V2 store and a stored plan in ``scope`` (the kernel tests' world)."""
    plan_id, plan_digest = await seed_plan(engine, scope)
    store = FlowRunStateStore(engine, policy=TEST_POLICY, clock=clock)
    return KernelWorld(engine, scope, plan_id, plan_digest, clock, store)


async def v2_waiting_run(world: KernelWorld) -> str:
    """A FlowRuntimeV2 run parked in ``Waiting`` — its projection reads ``Paused``."""
    run_id = await start(world)
    [candidate] = [
        c for c in await world.store.eligible_work(world.org, QUEUE) if c.flow_run_id == run_id
    ]
    fence = await world.store.claim(world.org, candidate, lease_owner="v2")
    assert isinstance(fence, LeaseFence)
    fence = await world.store.mark_running(world.org, fence)
    await world.store.commit_step(
        world.org, fence, output=CheckpointInput({"w": 1}), advance=EnterWait()
    )
    return run_id


@contextmanager
def capture_inserts(engine: AsyncEngine, table: str) -> Iterator[list[dict[str, Any]]]:
    """Record the bound parameters of every INSERT into ``table`` on ``engine``: the
    columns a writer sent explicitly (a server default never appears here)."""
    seen: list[dict[str, Any]] = []

    def before(conn: Any, cursor: Any, statement: str, params: Any, ctx: Any, many: Any) -> None:
        if ctx is None or not ctx.isinsert or ctx.compiled is None:
            return
        if ctx.compiled.statement.table.name != table:
            return
        seen.extend(dict(p) for p in ctx.compiled_parameters)

    event.listen(engine.sync_engine, "before_cursor_execute", before)
    try:
        yield seen
    finally:
        event.remove(engine.sync_engine, "before_cursor_execute", before)
