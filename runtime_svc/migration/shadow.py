"""Shadow comparison (§20.5): run the legacy interpreter and the compiled plan on the same
read-only/replayable fixture and compare them — element trace vs plan trace, outputs and
fault routing, declared vs observed resource classes, and the §18.2 projection — without
duplicating any business mutation or external effect (both sides run in memory on copies
of the fixture; nothing is written but the comparison's own evidence row).

* :func:`compare_scenario` — pure comparison of one Flow version source and its compiled
  plan (the compiler's differential test over the ``tests/flows`` corpus uses it).
* :func:`compare_flow_version` — the operator's comparison from authoritative state: the
  stored Flow version, its active plan and its subflows, on given scenarios; each result
  is persisted in ``flow_shadow_comparisons`` — the evidence a V2 cohort needs (§20.7) and
  the "projection divergence" of the release evidence (§23.3).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.compiler import ExecutionPlan, FlowDef
from runtime_svc.compiler.kinds import ExecutionProfile
from runtime_svc.definitions import repository as repo
from runtime_svc.legacy.ports import FlowLibrary, parse_source
from runtime_svc.migration.shadow_fixture import ActionClasses, declared_classes
from runtime_svc.migration.shadow_legacy import run_legacy
from runtime_svc.migration.shadow_model import Comparison, Scenario, compare
from runtime_svc.migration.shadow_plan import run_plan
from runtime_svc.records import RecordView
from runtime_svc.schema import plan_activations
from runtime_svc.schema_bridge import flow_shadow_comparisons
from services.db import db_now, transaction
from services.errors import FailedPreconditionError, NotFoundError

__all__ = ["PersistedComparison", "compare_flow_version", "compare_scenario"]


async def compare_scenario(
    source: Mapping[str, Any] | FlowDef,
    plan: ExecutionPlan,
    scenario: Scenario,
    *,
    view: RecordView | None,
    subflows: Mapping[tuple[str, int], FlowDef] | None = None,
) -> Comparison:
    """Compare the legacy interpreter with ``plan`` on ``scenario`` (module docstring)."""
    flow = source if isinstance(source, FlowDef) else parse_source(source)
    transform = plan.profile is ExecutionProfile.EMBEDDED_BEFORE_SAVE
    legacy = await run_legacy(
        flow,
        scenario,
        classes=ActionClasses.of(plan),
        view=view,
        subflows=subflows or {},
        transform=transform,
    )
    planned = await run_plan(plan, scenario, view=view)
    return compare(
        f"{flow.api_name}@{flow.version}",
        scenario,
        plan.plan_digest,
        legacy,
        planned,
        declared_classes(plan),
    )


class PersistedComparison:
    """A comparison and the id of its evidence row."""

    def __init__(self, comparison_id: str, comparison: Comparison) -> None:
        self.comparison_id = comparison_id
        self.comparison = comparison


async def _active_plan(engine: AsyncEngine, org_id: str, flow_version_id: str) -> repo.PlanRow:
    a = plan_activations.c
    async with transaction(engine, readonly=True) as conn:
        plan_id = (
            await conn.execute(
                select(a.plan_id).where(
                    a.org_id == org_id,
                    a.flow_version_id == flow_version_id,
                    a.state == repo.ACTIVE,
                )
            )
        ).scalar_one_or_none()
        if plan_id is None:
            raise FailedPreconditionError(
                f"Flow version {flow_version_id} has no active plan to compare",
                reason="shadow.no_active_plan",
            )
        row = await repo.get_plan_txn(conn, org_id, plan_id)
    if row is None:
        raise NotFoundError("execution_plan", plan_id)
    return row


async def compare_flow_version(
    engine: AsyncEngine,
    org_id: str,
    flow_version_id: str,
    scenarios: Sequence[Scenario],
    *,
    view: RecordView | None,
) -> list[PersistedComparison]:
    """Compare the stored Flow version with its active plan on every scenario and persist
    each outcome (the only rows this writes).

    Raises:
        NotFoundError: the Flow version is not in the org.
        FailedPreconditionError: it has no active plan.
    """
    if not scenarios:
        raise FailedPreconditionError("a shadow comparison needs at least one scenario")
    row = await _active_plan(engine, org_id, flow_version_id)
    plan = row.plan()
    async with transaction(engine, readonly=True) as conn:
        library = await FlowLibrary.load_txn(conn, org_id, flow_version_id)
    subflows = {key: library.subflow(*key) for key in _keys(plan)}
    results = []
    for scenario in scenarios:
        comparison = await compare_scenario(
            library.root,
            plan,
            scenario,
            view=view,
            subflows={k: v for k, v in subflows.items() if v is not None},
        )
        comparison_id = f"shc-{uuid.uuid4().hex}"
        async with transaction(engine) as conn:
            await conn.execute(
                flow_shadow_comparisons.insert().values(
                    org_id=org_id,
                    comparison_id=comparison_id,
                    flow_version_id=flow_version_id,
                    plan_digest=plan.plan_digest,
                    scenario_digest=comparison.scenario_digest,
                    outcome=comparison.outcome.value,
                    blocking=comparison.blocking,
                    divergences=json.dumps(
                        [d.to_dict() for d in comparison.divergences], sort_keys=True
                    )[:60_000],
                    compared_at=await db_now(conn),
                )
            )
        results.append(PersistedComparison(comparison_id, comparison))
    return results


def _keys(plan: ExecutionPlan) -> list[tuple[str, int]]:
    return [(pin.api_name, pin.version) for pin in plan.subflows]
