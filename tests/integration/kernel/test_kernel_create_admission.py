"""Run creation's one admission read (``store_create._admission_read``, ADR 0005
amendment): the deployment control record, the plan and the clock in one statement,
with the checks in their old order — a missing control record fails closed, closed V2
admission is refused before the plan is looked at, a plan outside the trusted work scope
answers like a missing one — and the store's clock still decides the durable times.
Control-record changes are made inside the creating transaction and rolled back."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest
import sqlalchemy as sa

from runtime_svc.kernel import CheckpointInput, StartRunRequest
from runtime_svc.migration.control import CONTROL_KEY
from runtime_svc.migration.protocol import V2AdmissionClosedError
from runtime_svc.schema import flow_runs
from runtime_svc.schema_bridge import flow_deployment_control
from services import db
from services.errors import FailedPreconditionError, NotFoundError
from tests.integration.kernel.conftest import World, new_scope
from tests.integration.kernel.helpers import FIRST

_CONTROL = flow_deployment_control.c.control_key == CONTROL_KEY


class _Rollback(Exception):
    """Ends a test transaction without committing it."""


def _request(plan_id: str) -> StartRunRequest:
    return StartRunRequest(plan_id=plan_id, first_step=FIRST, input=CheckpointInput({"n": 0}))


async def _runs(world: World) -> int:
    async with db.transaction(world.engine, readonly=True) as conn:
        stmt = sa.select(sa.func.count()).where(flow_runs.c.org_id == world.org)
        return int((await conn.execute(stmt)).scalar_one())


async def test_a_plan_outside_the_trusted_work_scope_answers_like_a_missing_one(
    world: World,
) -> None:
    with pytest.raises(NotFoundError):
        await world.store.create_run(world.scope, _request("plan_missing"))
    other_installation = dataclasses.replace(world.scope, app_installation_id="inst_other")
    with pytest.raises(NotFoundError):
        await world.store.create_run(other_installation, _request(world.plan_id))
    other_org = new_scope()  # same plan id, another org: the org predicate excludes it
    with pytest.raises(NotFoundError):
        await world.store.create_run(other_org, _request(world.plan_id))
    assert await _runs(world) == 0


async def test_a_missing_control_record_fails_closed(world: World) -> None:
    with pytest.raises(_Rollback):
        async with db.transaction(world.engine) as conn:
            await conn.execute(sa.delete(flow_deployment_control).where(_CONTROL))
            with pytest.raises(FailedPreconditionError) as exc:
                await world.store.create_run_txn(conn, world.scope, _request(world.plan_id))
            assert exc.value.reason == "deployment_control_missing"
            raise _Rollback
    assert await _runs(world) == 0


async def test_closed_admission_is_refused_before_the_plan_is_looked_at(world: World) -> None:
    with pytest.raises(_Rollback):
        async with db.transaction(world.engine) as conn:
            await conn.execute(
                sa.update(flow_deployment_control)
                .where(_CONTROL)
                .values(v2_admission_enabled=False)
            )
            for plan_id in (world.plan_id, "plan_missing"):
                with pytest.raises(V2AdmissionClosedError, match="v2_admission_disabled"):
                    await world.store.create_run_txn(conn, world.scope, _request(plan_id))
            raise _Rollback
    assert await _runs(world) == 0


async def test_the_stores_clock_decides_the_created_rows_times(world: World) -> None:
    """The admission read keeps the database clock as the transaction's ``db_now``; the
    store's (here shifted) clock is still what the created rows carry."""
    world.clock.advance(hours=5)
    async with db.transaction(world.engine) as conn:
        created = await world.store.create_run_txn(conn, world.scope, _request(world.plan_id))
        server_now = await db.db_now(conn)
    assert created.run.created_at == server_now + timedelta(hours=5)
    assert created.step is not None and created.step.created_at == created.run.created_at
