"""Resolution of a ``StartRun`` target to the ACTIVE plan of the caller's trusted work
scope (§18.3), through the definitions repository.

Anything in another org or another installation/capability/binding of the same org
answers exactly like a missing row (``NOT_FOUND``, ARCHITECTURE §3); a plan that exists
in scope but is not the active one is ``FAILED_PRECONDITION``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncConnection

from runtime_svc.compiler.kinds import QueueClass
from runtime_svc.compiler.plan import ExecutionPlan, PlanStep
from runtime_svc.definitions import repository as repo
from runtime_svc.kernel import FirstStep, RunRecord
from runtime_svc.runs.inputs import DeclaredVariable
from services.auth import TrustedRuntimeWorkScope
from services.errors import FailedPreconditionError, NotFoundError

__all__ = [
    "AUTOLAUNCHED",
    "FlowTarget",
    "ResolvedPlan",
    "first_step_of",
    "plan_of_run_txn",
    "resolve_plan_by_id_txn",
    "resolve_plan_txn",
]

AUTOLAUNCHED = "autolaunched"

#: Lane of a start step the compiler left unassigned, by profile (§16.1).
_DEFAULT_LANE: dict[str, QueueClass] = {
    "embedded_before_save": QueueClass.EMBEDDED_FOREGROUND,
    "bounded_atomic": QueueClass.BOUNDED_ATOMIC_FOREGROUND,
    "durable_orchestration": QueueClass.DURABLE_MUTATION,
}


@dataclass(frozen=True)
class FlowTarget:
    """``StartRun`` by Flow API name; ``version_number`` 0 = the active version."""

    flow_api_name: str
    version_number: int = 0


@dataclass(frozen=True)
class ResolvedPlan:
    """The active plan a run is accepted on."""

    row: repo.PlanRow
    plan: ExecutionPlan
    flow_api_name: str

    @property
    def variables(self) -> tuple[DeclaredVariable, ...]:
        """Declared variables, for input/output projection."""
        return tuple(
            DeclaredVariable(v.name, v.type, v.input, v.output) for v in self.plan.variables
        )


def first_step_of(plan: ExecutionPlan, profile: str) -> FirstStep:
    """The compiled entry step of ``plan``.

    Raises:
        FailedPreconditionError: the plan has no start step (never for a verified plan).
    """
    step: PlanStep | None = next((s for s in plan.steps if s.key == plan.start_step), None)
    if step is None:
        raise FailedPreconditionError("the plan has no start step", reason="plan_without_start")
    lane_class = step.queue_class or _DEFAULT_LANE.get(profile)
    lane = lane_class.value if lane_class is not None else ""
    return FirstStep(plan_step_key=step.key, step_kind=step.kind.value, queue_class=lane)


def _in_scope(row: repo.PlanRow | None, scope: TrustedRuntimeWorkScope) -> bool:
    return row is not None and dataclasses.astuple(row.scope) == dataclasses.astuple(scope)


async def _plan_in_scope(
    conn: AsyncConnection, scope: TrustedRuntimeWorkScope, plan_id: str
) -> repo.PlanRow:
    row = await repo.get_plan_txn(conn, scope.org_id, plan_id)
    if row is None or not _in_scope(row, scope):
        raise NotFoundError("execution_plan", plan_id)
    return row


def _autolaunched(row: repo.PlanRow, api_name: str) -> ResolvedPlan:
    plan = row.plan()
    if plan.flow.process_type != AUTOLAUNCHED:
        raise FailedPreconditionError(
            f"{api_name} is a {plan.flow.process_type} Flow; StartRun starts autolaunched "
            "Flows only",
            reason="not_autolaunched",
            attributes={"flow_api_name": api_name},
        )
    return ResolvedPlan(row, plan, api_name)


async def resolve_plan_txn(
    conn: AsyncConnection, scope: TrustedRuntimeWorkScope, target: FlowTarget
) -> ResolvedPlan:
    """The ACTIVE plan of ``target`` in ``scope``.

    Raises:
        NotFoundError: no such Flow/version, or no active activation in this scope.
        FailedPreconditionError: the requested version is not the active one, or the
            Flow is not autolaunched.
    """
    name = target.flow_api_name
    act = await repo.active_activation_txn(
        conn, scope.org_id, name, scope.app_installation_id, scope.runtime_capability_id
    )
    if act is None or act.plan_id is None:
        raise NotFoundError("flow_activation", name)
    if target.version_number:
        version = await repo.get_flow_version_by_number_txn(
            conn, scope.org_id, name, target.version_number
        )
        if version is None:
            raise NotFoundError("flow_version", f"{name}@{target.version_number}")
        if version.flow_version_id != act.flow_version_id:
            raise FailedPreconditionError(
                f"{name} version {target.version_number} is not the active version",
                reason="version_not_active",
                attributes={"flow_api_name": name},
            )
    return _autolaunched(await _plan_in_scope(conn, scope, act.plan_id), name)


async def resolve_plan_by_id_txn(
    conn: AsyncConnection, scope: TrustedRuntimeWorkScope, plan_id: str
) -> ResolvedPlan:
    """The plan ``plan_id`` of ``scope``, which must be its Flow's active plan.

    Raises:
        NotFoundError: no such plan in this scope.
        FailedPreconditionError: the plan is not active, or not autolaunched.
    """
    row = await _plan_in_scope(conn, scope, plan_id)
    version = await repo.get_flow_version_txn(conn, scope.org_id, row.flow_version_id)
    if version is None:
        raise NotFoundError("execution_plan", plan_id)
    act = await repo.active_activation_txn(
        conn,
        scope.org_id,
        version.flow_api_name,
        scope.app_installation_id,
        scope.runtime_capability_id,
    )
    if act is None or act.plan_id != plan_id:
        raise FailedPreconditionError(
            f"plan {plan_id} is not the active plan of {version.flow_api_name}",
            reason="plan_not_active",
            attributes={"flow_api_name": version.flow_api_name},
        )
    return _autolaunched(row, version.flow_api_name)


async def plan_of_run_txn(
    conn: AsyncConnection, scope: TrustedRuntimeWorkScope, run: RunRecord
) -> ResolvedPlan:
    """The plan an accepted run is bound to (active or not: in-flight runs keep their
    plan), with its Flow's API name.

    Raises:
        NotFoundError: the plan is not in ``scope`` (never for a run of the scope).
    """
    row = await _plan_in_scope(conn, scope, run.plan_id)
    version = await repo.get_flow_version_txn(conn, scope.org_id, row.flow_version_id)
    name = "" if version is None else version.flow_api_name
    return ResolvedPlan(row, row.plan(), name)
