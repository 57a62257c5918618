"""Migration cohorts (§20.6-§20.8): which owner a NEW run gets.

A cohort flag is set per ``(OrgID, Flow version, execution profile)`` in
``flow_migration_cohorts``; without one, the deployment default of the control record
applies (``LegacyInterpreter`` for an adopter until "Default V2 ownership", §20.1 G).
The choice is made once, at admission, inside the admitting transaction, and is final
for that run: a run's owner and epoch are immutable (§20.6) — changing a flag affects
new runs only, and existing legacy runs drain where they are (§20.8).

When V2 is chosen but V2 admission is closed (gates not passed, quarantine, or
admission disabled for rollback), the new run returns to the compatible legacy cohort
(§20.9) — it is never silently half-admitted, and no existing V2 run is touched.

Enabling a cohort for V2 needs its own evidence pack (§20.7): a recorded shadow
comparison of that Flow version with no blocking divergence, and the bridge gates passed.
The §20.7 cohort order is data (:data:`COHORT_ORDER`, the compiler's classification):
cohorts 5-7 (time waits, producer waits, external effects) are enabled exactly like the
others once their evidence exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.definitions.inventory import Cohort
from runtime_svc.kernel.states import ExecutionOwner
from runtime_svc.migration.control import DeploymentControl, lock_control_txn, read_control_txn
from runtime_svc.migration.gates import v2_admission_refusal
from runtime_svc.migration.protocol import binary_generation
from runtime_svc.schema_bridge import flow_migration_cohorts, flow_shadow_comparisons
from services.db import db_now, insert_if_absent, transaction
from services.errors import FailedPreconditionError, FenceLostError, NotFoundError
from services.invariants import InvariantError

__all__ = [
    "COHORT_ORDER",
    "CohortFlag",
    "CohortRefusedError",
    "OwnerChoice",
    "choose_owner",
    "choose_owner_txn",
    "list_cohorts",
    "set_cohort",
]

#: §20.7 recommended order, as the inventory classifies Flow versions.
COHORT_ORDER: tuple[Cohort, ...] = tuple(Cohort)


@dataclass(frozen=True)
class CohortFlag:
    """One cohort row."""

    org_id: str
    flow_version_id: str
    execution_profile: str
    cohort: str
    new_run_owner: ExecutionOwner
    evidence_comparison_id: str | None
    enabled_at: datetime | None
    disabled_at: datetime | None
    state_version: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "org_id": self.org_id,
            "flow_version_id": self.flow_version_id,
            "execution_profile": self.execution_profile,
            "cohort": self.cohort,
            "new_run_owner": self.new_run_owner.code,
            "evidence_comparison_id": self.evidence_comparison_id,
            "enabled_at": None if self.enabled_at is None else self.enabled_at.isoformat(),
            "disabled_at": None if self.disabled_at is None else self.disabled_at.isoformat(),
            "state_version": self.state_version,
        }

    @classmethod
    def from_row(cls, r: Any) -> CohortFlag:
        return cls(
            r["org_id"],
            r["flow_version_id"],
            r["execution_profile"],
            r["cohort"],
            ExecutionOwner.from_code(r["new_run_owner"]),
            r["evidence_comparison_id"],
            r["enabled_at"],
            r["disabled_at"],
            int(r["state_version"]),
        )


@dataclass(frozen=True)
class OwnerChoice:
    """The owner of one new run and why."""

    owner: ExecutionOwner
    reason: str


def choose_owner(
    control: DeploymentControl, flag: CohortFlag | None, *, generation: int
) -> OwnerChoice:
    """Pure owner selection for a new run (see the module docstring)."""
    desired = control.default_new_run_owner if flag is None else flag.new_run_owner
    source = "deployment_default" if flag is None else "cohort"
    if desired is ExecutionOwner.LEGACY_INTERPRETER:
        return OwnerChoice(desired, f"{source}_legacy")
    refusal = v2_admission_refusal(control, generation)
    if refusal is not None:
        return OwnerChoice(ExecutionOwner.LEGACY_INTERPRETER, f"v2_admission_closed.{refusal}")
    return OwnerChoice(ExecutionOwner.FLOW_RUNTIME_V2, f"{source}_v2")


async def _flag_txn(
    conn: AsyncConnection, org_id: str, flow_version_id: str, profile: str
) -> CohortFlag | None:
    t = flow_migration_cohorts.c
    row = (
        (
            await conn.execute(
                select(flow_migration_cohorts).where(
                    t.org_id == org_id,
                    t.flow_version_id == flow_version_id,
                    t.execution_profile == profile,
                )
            )
        )
        .mappings()
        .first()
    )
    return None if row is None else CohortFlag.from_row(row)


async def choose_owner_txn(
    conn: AsyncConnection, org_id: str, flow_version_id: str, profile: str
) -> OwnerChoice:
    """:func:`choose_owner` on the facts read in the caller's (admitting) transaction."""
    control = await read_control_txn(conn)
    flag = await _flag_txn(conn, org_id, flow_version_id, profile)
    return choose_owner(control, flag, generation=binary_generation())


class CohortRefusedError(FailedPreconditionError):
    """A cohort flag change was refused (gates, evidence)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message, reason=f"cohort.{reason}")


async def _evidence_ok(
    conn: AsyncConnection, org_id: str, flow_version_id: str, comparison_id: str
) -> None:
    s = flow_shadow_comparisons.c
    row = (
        (
            await conn.execute(
                select(flow_shadow_comparisons).where(
                    s.org_id == org_id, s.comparison_id == comparison_id
                )
            )
        )
        .mappings()
        .first()
    )
    if row is None or row["flow_version_id"] != flow_version_id:
        raise NotFoundError("shadow_comparison", comparison_id)
    if row["outcome"] == "diverged" or row["blocking"]:
        raise CohortRefusedError(
            "evidence_blocking",
            f"shadow comparison {comparison_id} has {row['outcome']} divergence "
            "that blocks V2 ownership of this Flow version",
        )


async def set_cohort(
    engine: AsyncEngine,
    org_id: str,
    flow_version_id: str,
    profile: str,
    owner: ExecutionOwner,
    *,
    cohort: str,
    evidence_comparison_id: str | None = None,
) -> CohortFlag:
    """Set the owner of NEW runs of one ``(org, Flow version, profile)`` cohort.

    Raises:
        CohortRefusedError: V2 without passed gates or without non-blocking evidence.
        NotFoundError: the evidence comparison is not of this org and Flow version.
    """
    if cohort not in {c.value for c in Cohort}:
        raise CohortRefusedError("unknown_cohort", f"{cohort!r} is not a §20.7 cohort")
    async with transaction(engine) as conn:
        control = await lock_control_txn(conn)  # serialises with admission changes
        if owner is ExecutionOwner.FLOW_RUNTIME_V2:
            if not control.gates_passed:
                raise CohortRefusedError(
                    "write_protocol_not_enabled",
                    "a V2 cohort needs the accepted bridge release and write protocol",
                )
            if evidence_comparison_id is None:
                raise CohortRefusedError(
                    "evidence_missing", "a V2 cohort needs its shadow-comparison evidence"
                )
            await _evidence_ok(conn, org_id, flow_version_id, evidence_comparison_id)
        now = await db_now(conn)
        existing = await _flag_txn(conn, org_id, flow_version_id, profile)
        values = {
            "cohort": cohort,
            "new_run_owner": owner.code,
            "evidence_comparison_id": evidence_comparison_id,
            "enabled_at": now if owner is ExecutionOwner.FLOW_RUNTIME_V2 else None,
            "disabled_at": None if owner is ExecutionOwner.FLOW_RUNTIME_V2 else now,
            "updated_at": now,
        }
        t = flow_migration_cohorts.c
        if existing is None:
            inserted = await insert_if_absent(
                conn,
                flow_migration_cohorts,
                {
                    "org_id": org_id,
                    "flow_version_id": flow_version_id,
                    "execution_profile": profile,
                    "state_version": 0,
                    "created_at": now,
                    **values,
                },
            )
            if not inserted:
                raise FenceLostError("flow_migration_cohorts", flow_version_id, 0, None)
        else:
            result = await conn.execute(
                flow_migration_cohorts.update()
                .where(
                    t.org_id == org_id,
                    t.flow_version_id == flow_version_id,
                    t.execution_profile == profile,
                    t.state_version == existing.state_version,
                )
                .values({**values, "state_version": t.state_version + 1})
            )
            if result.rowcount != 1:
                raise FenceLostError(
                    "flow_migration_cohorts", flow_version_id, existing.state_version, None
                )
        flag = await _flag_txn(conn, org_id, flow_version_id, profile)
        if flag is None:
            raise InvariantError("broken invariant: flag is not None")
        return flag


async def list_cohorts(engine: AsyncEngine, org_id: str | None = None) -> list[CohortFlag]:
    """Cohort flags (of one org, or the whole deployment for release evidence)."""
    t = flow_migration_cohorts.c
    stmt = select(flow_migration_cohorts).order_by(t.org_id, t.flow_version_id, t.execution_profile)
    if org_id is not None:
        stmt = stmt.where(t.org_id == org_id)
    async with transaction(engine, readonly=True) as conn:
        return [CohortFlag.from_row(r) for r in (await conn.execute(stmt)).mappings()]
