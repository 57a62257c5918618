"""Ownership reconciliation (§20.6, §20.9, §22.8 "reconciliation reports zero dual
ownership"): what the database says about who owns which run.

A run is *dual-owned* when the data shows both schedulers had a hand in it or its owner
tuple is one neither scheduler accepts:

* ``legacy_epoch_nonzero`` — ``LegacyInterpreter`` with an epoch other than 0;
* ``v2_epoch_zero`` — ``FlowRuntimeV2`` with epoch < 1;
* ``unknown_owner`` — an owner code that is neither;
* ``legacy_with_v2_lifecycle`` — a legacy run with V2 step or checkpoint rows;
* ``v2_with_legacy_state`` — a V2 run carrying a legacy context or claim;
* ``legacy_with_plan`` / ``v2_without_plan`` — the plan pointer contradicts the owner;
* ``step_epoch_mismatch`` — a step whose epoch differs from its root's.

The count must read zero; :func:`metrics_text` renders it (and the per-owner run counts)
in the Prometheus text format for a scrape job or a node-exporter textfile until the
runtime's metrics endpoint lands. The report also counts what rollback and legacy
retirement need: quarantined runs per owner, non-terminal legacy runs (§20.8 retirement
requires zero), and pre-bridge rows written after their adoption.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import and_, func, literal, or_, select, union_all
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.sql import Select

from runtime_svc.kernel.states import ExecutionOwner, RunState
from runtime_svc.schema import flow_checkpoints, flow_runs, flow_step_executions
from runtime_svc.schema_bridge import flow_interviews
from services.db import db_now, transaction

__all__ = ["DUAL_OWNERSHIP_KINDS", "OwnershipReport", "metrics_text", "reconcile_ownership"]

_LEGACY = ExecutionOwner.LEGACY_INTERPRETER.code
_V2 = ExecutionOwner.FLOW_RUNTIME_V2.code
_TERMINAL = (
    RunState.SUCCEEDED.code,
    RunState.TERMINAL_FAILED.code,
    RunState.QUARANTINED.code,
    RunState.CANCELLED.code,
)
_MAX_SAMPLES = 50

#: Every kind of dual ownership the report looks for (module docstring).
DUAL_OWNERSHIP_KINDS = (
    "legacy_epoch_nonzero",
    "v2_epoch_zero",
    "unknown_owner",
    "legacy_with_v2_lifecycle",
    "v2_with_legacy_state",
    "legacy_with_plan",
    "v2_without_plan",
    "step_epoch_mismatch",
)


@dataclass(frozen=True)
class OwnershipReport:
    """The reconciliation of one deployment (or one org)."""

    observed_at: datetime
    org_id: str | None
    runs_by_owner: Mapping[tuple[str, int], int]
    dual_ownership: Mapping[str, int]
    samples: tuple[Mapping[str, str], ...]
    quarantined_by_owner: Mapping[str, int]
    non_terminal_legacy: int
    prebridge_writes_after_adoption: int
    details: Mapping[str, Any] = field(default_factory=dict)

    @property
    def dual_ownership_total(self) -> int:
        return sum(self.dual_ownership.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "observed_at": self.observed_at.isoformat(),
            "org_id": self.org_id,
            "runs_by_owner": [
                {"execution_owner": o, "ownership_epoch": e, "runs": n}
                for (o, e), n in sorted(self.runs_by_owner.items())
            ],
            "dual_ownership_total": self.dual_ownership_total,
            "dual_ownership": dict(self.dual_ownership),
            "samples": [dict(s) for s in self.samples],
            "quarantined_by_owner": dict(self.quarantined_by_owner),
            "non_terminal_legacy": self.non_terminal_legacy,
            "prebridge_writes_after_adoption": self.prebridge_writes_after_adoption,
        }


def _checks(org_id: str | None) -> list[Select[Any]]:
    """One ``SELECT kind, org_id, flow_run_id`` per dual-ownership kind."""
    r, s, c = flow_runs.c, flow_step_executions.c, flow_checkpoints.c
    scope = [] if org_id is None else [r.org_id == org_id]

    def runs(kind: str, *where: Any) -> Select[Any]:
        return select(literal(kind).label("kind"), r.org_id, r.flow_run_id).where(*scope, *where)

    has_step = (
        select(s.step_execution_id)
        .where(s.org_id == r.org_id, s.flow_run_id == r.flow_run_id)
        .exists()
    )
    has_checkpoint = (
        select(c.checkpoint_id).where(c.org_id == r.org_id, c.flow_run_id == r.flow_run_id).exists()
    )
    step_mismatch = (
        select(s.step_execution_id)
        .where(
            s.org_id == r.org_id,
            s.flow_run_id == r.flow_run_id,
            s.ownership_epoch != r.ownership_epoch,
        )
        .exists()
    )
    return [
        runs("legacy_epoch_nonzero", r.execution_owner == _LEGACY, r.ownership_epoch != 0),
        runs("v2_epoch_zero", r.execution_owner == _V2, r.ownership_epoch < 1),
        runs("unknown_owner", r.execution_owner.not_in([_LEGACY, _V2])),
        runs(
            "legacy_with_v2_lifecycle", r.execution_owner == _LEGACY, or_(has_step, has_checkpoint)
        ),
        runs(
            "v2_with_legacy_state",
            r.execution_owner == _V2,
            or_(r.legacy_context.is_not(None), r.legacy_claimed_by.is_not(None)),
        ),
        runs("legacy_with_plan", r.execution_owner == _LEGACY, r.plan_id.is_not(None)),
        runs("v2_without_plan", r.execution_owner == _V2, r.plan_id.is_(None)),
        runs("step_epoch_mismatch", step_mismatch),
    ]


async def _dual_txn(
    conn: AsyncConnection, org_id: str | None
) -> tuple[dict[str, int], list[dict[str, str]]]:
    checks = union_all(*_checks(org_id)).subquery()
    counts = {kind: 0 for kind in DUAL_OWNERSHIP_KINDS}
    for kind, n in await conn.execute(select(checks.c.kind, func.count()).group_by(checks.c.kind)):
        counts[str(kind)] = int(n)
    samples = [
        {"kind": str(k), "org_id": str(o), "flow_run_id": str(i)}
        for k, o, i in await conn.execute(
            select(checks.c.kind, checks.c.org_id, checks.c.flow_run_id)
            .order_by(checks.c.kind, checks.c.org_id, checks.c.flow_run_id)
            .limit(_MAX_SAMPLES)
        )
    ]
    return counts, samples


async def reconcile_ownership(engine: AsyncEngine, org_id: str | None = None) -> OwnershipReport:
    """Read the reconciliation (one read-only transaction, bounded sample)."""
    r, p = flow_runs.c, flow_interviews.c
    scope = [] if org_id is None else [r.org_id == org_id]
    async with transaction(engine, readonly=True) as conn:
        now = await db_now(conn)
        by_owner = {
            (str(o), int(e)): int(n)
            for o, e, n in await conn.execute(
                select(r.execution_owner, r.ownership_epoch, func.count())
                .where(*scope)
                .group_by(r.execution_owner, r.ownership_epoch)
            )
        }
        dual, samples = await _dual_txn(conn, org_id)
        quarantined = {
            str(o): int(n)
            for o, n in await conn.execute(
                select(r.execution_owner, func.count())
                .where(*scope, r.runtime_state == RunState.QUARANTINED.code)
                .group_by(r.execution_owner)
            )
        }
        non_terminal = int(
            (
                await conn.execute(
                    select(func.count()).where(
                        *scope, r.execution_owner == _LEGACY, r.runtime_state.not_in(_TERMINAL)
                    )
                )
            ).scalar_one()
        )
        prebridge_scope = [] if org_id is None else [p.org_id == org_id]
        late_writes = int(
            (
                await conn.execute(
                    select(func.count()).where(
                        *prebridge_scope,
                        p.adopted_at.is_not(None),
                        and_(p.updated_at > p.adopted_at),
                    )
                )
            ).scalar_one()
        )
    return OwnershipReport(
        now, org_id, by_owner, dual, tuple(samples), quarantined, non_terminal, late_writes
    )


def metrics_text(report: OwnershipReport) -> str:
    """The report as Prometheus text exposition (gauges; low-cardinality labels)."""
    lines = [
        "# HELP nexus_flow_dual_ownership_runs Runs whose data shows two owners (must be 0).",
        "# TYPE nexus_flow_dual_ownership_runs gauge",
    ]
    for kind in DUAL_OWNERSHIP_KINDS:
        lines.append(
            f'nexus_flow_dual_ownership_runs{{kind="{kind}"}} {report.dual_ownership.get(kind, 0)}'
        )
    lines += [
        "# HELP nexus_flow_runs_by_owner Flow runs per execution owner and ownership epoch.",
        "# TYPE nexus_flow_runs_by_owner gauge",
    ]
    for (owner, epoch), n in sorted(report.runs_by_owner.items()):
        lines.append(f'nexus_flow_runs_by_owner{{owner="{owner}",epoch="{epoch}"}} {n}')
    lines += [
        "# HELP nexus_flow_legacy_non_terminal_runs Non-terminal LegacyInterpreter runs.",
        "# TYPE nexus_flow_legacy_non_terminal_runs gauge",
        f"nexus_flow_legacy_non_terminal_runs {report.non_terminal_legacy}",
        "# HELP nexus_flow_prebridge_writes_after_adoption Pre-bridge rows changed after "
        "adoption (must be 0).",
        "# TYPE nexus_flow_prebridge_writes_after_adoption gauge",
        f"nexus_flow_prebridge_writes_after_adoption {report.prebridge_writes_after_adoption}",
    ]
    return "\n".join(lines) + "\n"
