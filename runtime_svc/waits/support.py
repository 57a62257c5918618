"""Read paths of durable waits: the §19 support read's dependency correlation, and the
consumed signal a resuming step reads (an ``EffectCompletion`` step routes success,
fault or quarantine on its evidence, §15.2).

Org-scoped like every read; the consumed signal is looked up in the dependency's own
work scope, so it can never be another scope's signal.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncConnection

from runtime_svc.kernel.wait_model import DependencyRecord, DependencyState, SignalRecord
from runtime_svc.schema import flow_step_executions
from runtime_svc.waits import queries

__all__ = [
    "DependencySupport",
    "consumed_signal_of_dependency_txn",
    "consumed_signal_txn",
    "dependency_support_txn",
]


@dataclass(frozen=True)
class DependencySupport:
    """One dependency as the support read shows it: producer, age, reconciliation
    attempts, the waiting step's plan key and the consumed signal."""

    dependency: DependencyRecord
    plan_step_key: str
    consumed_signal: SignalRecord | None
    age: timedelta


async def consumed_signal_of_dependency_txn(
    conn: AsyncConnection, dep: DependencyRecord
) -> SignalRecord | None:
    """The signal ``dep``'s resolution consumed (``None``: none was — a timer, or a
    record condition read from the record itself)."""
    if dep.wake_signal_id is None:
        return None
    return await queries.signal_by_id_txn(conn, dep.scope, dep.wake_signal_id)


async def consumed_signal_txn(
    conn: AsyncConnection, org_id: str, step_execution_id: str
) -> tuple[DependencyRecord, SignalRecord | None] | None:
    """The resolved dependency of a resuming step and the signal it consumed, or
    ``None`` when the step has no resolved dependency.

    The ``EffectCompletion`` step reads the effect owner's receipt here: the signal's
    ``evidence_json`` holds ``command_id``, ``outcome_version``, ``outcome``
    (``SUCCEEDED``/``FAILED``/``OUTCOME_UNKNOWN``), ``safe_error_code``,
    ``result_digest``, ``effect_owner_kind`` and ``effect_handoff_key``.
    """
    dep = await queries.dependency_of_step_txn(conn, org_id, step_execution_id)
    if dep is None or dep.state is not DependencyState.RESOLVED:
        return None
    return dep, await consumed_signal_of_dependency_txn(conn, dep)


async def dependency_support_txn(
    conn: AsyncConnection, org_id: str, flow_run_id: str, now: datetime
) -> list[DependencySupport]:
    """Every dependency of ``(org_id, flow_run_id)`` with its support details."""
    deps = await queries.dependencies_of_run_txn(conn, org_id, flow_run_id)
    if not deps:
        return []
    s = flow_step_executions.c
    keys = {
        str(a): str(b)
        for a, b in (
            await conn.execute(
                select(s.step_execution_id, s.plan_step_key).where(
                    s.org_id == org_id,
                    s.step_execution_id.in_([d.step_execution_id for d in deps]),
                )
            )
        ).all()
    }
    out = []
    for dep in deps:
        end = dep.resolved_at or now
        out.append(
            DependencySupport(
                dep,
                keys.get(dep.step_execution_id, ""),
                await consumed_signal_of_dependency_txn(conn, dep),
                max(end - dep.created_at, timedelta(0)),
            )
        )
    return out
