"""Activation checks every dependency against the runtime's producer registry (§10.5,
issue 11): a producer kind that is not registered — or has neither notification nor
bounded reconciliation — blocks activation with a diagnostic naming the step, and the
blocked attempt is recorded; registered ones activate. SQLite and MariaDB."""

from __future__ import annotations

import json
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.definitions import DefinitionService
from runtime_svc.definitions.errors import ActivationBlockedError
from runtime_svc.schema import execution_plans, plan_activations
from runtime_svc.waits.registry import ProducerRegistry
from services import db
from services.errors import InvalidArgumentError
from tests.integration.definitions.harness import new_org
from tests.integration.definitions.memory_catalog import MemoryCatalog
from tests.integration.waits.support import record_flow, signal_flow, timer_flow
from tests.unit.compiler.compiler_corpus import read_flow


async def _compile_and_activate(
    engine: AsyncEngine, source: dict[str, Any], registry: ProducerRegistry, org: str = ""
) -> tuple[str, Any]:
    org = org or new_org()
    catalog = MemoryCatalog()
    scope, snap = catalog.publish(org)
    svc = DefinitionService(engine, catalog, producers=registry)
    fv = await svc.register_flow_version(org, "", json.dumps(source))
    outcome = await svc.compile_flow_version(
        scope, fv.flow_version_id, snap.generation_id, snap.catalog_digest
    )
    assert outcome.compiled and outcome.plan is not None, outcome.diagnostics
    plan = outcome.plan
    result = await svc.activate_flow_version(
        scope, "req-1", fv.flow_version_id, plan.plan_id, plan.plan_digest
    )
    return org, result


async def test_a_wait_on_an_unregistered_producer_blocks_activation_naming_the_step(
    engine: AsyncEngine,
) -> None:
    org = new_org()
    with pytest.raises(ActivationBlockedError) as err:
        await _compile_and_activate(
            engine, read_flow("durable_wait_action"), ProducerRegistry(), org
        )
    [issue] = err.value.diagnostics
    assert issue.code == "wait.producer_not_registered"
    assert issue.path == "steps[ask]" and "step ask" in issue.message
    assert "action:await_approval" in issue.message
    async with db.transaction(engine, readonly=True) as conn:
        a = plan_activations.c
        rows = (await conn.execute(select(plan_activations).where(a.org_id == org))).mappings()
        [row] = list(rows)
    assert row["state"] == "BLOCKED" and row["plan_id"] is None
    assert "wait.producer_not_registered" in row["attempt_diagnostics"]


async def test_an_event_wait_activates_only_where_its_signal_kind_is_registered(
    engine: AsyncEngine,
) -> None:
    source = signal_flow(kind="approval.decision")
    with pytest.raises(ActivationBlockedError) as err:
        await _compile_and_activate(engine, source, ProducerRegistry())
    assert [d.code for d in err.value.diagnostics] == ["wait.producer_not_registered"]
    org, _ = await _compile_and_activate(engine, source, ProducerRegistry(("approval.decision",)))
    async with db.transaction(engine, readonly=True) as conn:
        a = plan_activations.c
        states = (await conn.execute(select(a.state).where(a.org_id == org))).scalars().all()
    assert list(states) == ["ACTIVE"]


@pytest.mark.parametrize(
    "source",
    [timer_flow(), record_flow(), signal_flow(kind="approval.decision")],
    ids=["time", "record", "external"],
)
async def test_the_built_in_and_configured_producers_activate(
    engine: AsyncEngine, source: dict[str, Any]
) -> None:
    registry = ProducerRegistry(("approval.decision",))
    _, outcome = await _compile_and_activate(engine, source, registry)
    assert outcome.activation.state == "ACTIVE"


@pytest.mark.parametrize(
    ("wait", "deadline", "code"),
    [
        ({"kind": "time", "duration": "-PT1H"}, "PT2H", "source.invalid_value"),
        ({"kind": "time", "duration": "PT0S"}, "PT2H", "source.invalid_value"),
        ({"kind": "time", "duration": "P99999W"}, "P99999W", "wait.deadline_exceeds_policy"),
        ({"kind": "time", "duration": "P3D"}, "P1D", "wait.deadline_before_resume"),
        ({"kind": "time", "duration": "P1M"}, "P1D", "source.invalid_value"),
    ],
    ids=["negative", "zero", "absurd", "beyond-deadline", "calendar-month"],
)
async def test_negative_or_absurd_durations_are_refused_and_no_plan_is_written(
    engine: AsyncEngine, wait: dict[str, Any], deadline: str, code: str
) -> None:
    org = new_org()
    catalog = MemoryCatalog()
    scope, snap = catalog.publish(org)
    svc = DefinitionService(engine, catalog)
    source = timer_flow(deadline=deadline)
    source["elements"][0]["wait"] = wait
    try:
        fv = await svc.register_flow_version(org, "", json.dumps(source))
    except InvalidArgumentError as exc:
        # Malformed at the source: refused at registration (INVALID_ARGUMENT).
        assert f"[{code}]" in str(exc)
    else:
        # Well-formed but beyond the policy: the compile is refused with a diagnostic.
        outcome = await svc.compile_flow_version(
            scope, fv.flow_version_id, snap.generation_id, snap.catalog_digest
        )
        assert not outcome.compiled and outcome.plan is None
        assert code in {d.code for d in outcome.diagnostics}, outcome.diagnostics
    async with db.transaction(engine, readonly=True) as conn:
        p = execution_plans.c
        plans = (await conn.execute(select(p.plan_id).where(p.org_id == org))).all()
    assert plans == []
