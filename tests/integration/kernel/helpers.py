"""Helpers of the kernel store tests: start a run, claim it, read rows back."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Table, func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.kernel import (
    CheckpointInput,
    FirstStep,
    FlowRunStateStore,
    LeaseFence,
    NextStep,
    NotEligible,
    StartRunRequest,
)
from services import db
from tests.integration.kernel.conftest import World

QUEUE = "durable_mutation"
FIRST = FirstStep(plan_step_key="s1", step_kind="PureCompute", queue_class=QUEUE)


def next_step(key: str = "s2", kind: str = "BoundedMutation") -> NextStep:
    return NextStep(step_execution_id="", plan_step_key=key, step_kind=kind, queue_class=QUEUE)


async def start(world: World, *, key: str | None = None, context: Any = None) -> str:
    request = StartRunRequest(
        plan_id=world.plan_id,
        first_step=FIRST,
        input=CheckpointInput(context={"n": 0} if context is None else context),
        idempotency_key=key,
    )
    return (await world.store.create_run(world.scope, request)).run.flow_run_id


async def claim(
    world: World, run_id: str, *, store: FlowRunStateStore | None = None, owner: str = "w1"
) -> LeaseFence:
    """Claim the run's due current step (fails the test when it is not eligible)."""
    chosen = store or world.store
    candidates = [
        c for c in await chosen.eligible_work(world.org, QUEUE) if c.flow_run_id == run_id
    ]
    assert len(candidates) == 1, candidates
    fence = await chosen.claim(world.org, candidates[0], lease_owner=owner)
    assert isinstance(fence, LeaseFence), fence
    return fence


async def claim_result(world: World, run_id: str) -> LeaseFence | NotEligible:
    candidates = [
        c for c in await world.store.eligible_work(world.org, QUEUE) if c.flow_run_id == run_id
    ]
    if not candidates:
        return NotEligible("not_listed")
    return await world.store.claim(world.org, candidates[0], lease_owner="w")


async def rows(engine: AsyncEngine, table: Table, **where: Any) -> list[dict[str, Any]]:
    async with db.transaction(engine, readonly=True) as conn:
        stmt = select(table).where(*(table.c[k] == v for k, v in where.items()))
        return [dict(r) for r in (await conn.execute(stmt)).mappings()]


async def count(engine: AsyncEngine, table: Table, **where: Any) -> int:
    async with db.transaction(engine, readonly=True) as conn:
        stmt = select(func.count()).select_from(table)
        stmt = stmt.where(*(table.c[k] == v for k, v in where.items()))
        return int((await conn.execute(stmt)).scalar_one())
