"""The persisted deployment control record (§20.3): ``FlowInterviewWriteProtocolGeneration``
and the evidence of the drain and org-schema gates.

One row (:data:`CONTROL_KEY`) in ``flow_deployment_control``. Every change is a
compare-and-swap on its ``state_version`` after the row was locked ``FOR UPDATE`` — the
same lock the fleet registry takes when a process registers, so a gate and a starting
binary serialise on it. No rollback or gate ever uses manual SQL (§20.9): the typed
operations of :mod:`runtime_svc.migration.bridge` are the control plane.

A missing record is a broken installation and fails closed (V2 admission refused).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from runtime_svc.kernel.states import ExecutionOwner
from runtime_svc.schema_bridge import flow_deployment_control
from services.errors import FailedPreconditionError, FenceLostError

__all__ = [
    "CONTROL_KEY",
    "DeploymentControl",
    "Origin",
    "Phase",
    "lock_control_txn",
    "read_control_txn",
    "update_control_txn",
]

CONTROL_KEY = "flow_interview_write_protocol"


class Phase(StrEnum):
    """Where the deployment is on the §20.1 bridge path (in order)."""

    ADDITIVE = "additive"
    DRAINED = "drained"
    ORG_SCHEMA_VERIFIED = "org_schema_verified"
    WRITE_PROTOCOL_ENABLED = "write_protocol_enabled"

    @property
    def rank(self) -> int:
        return list(Phase).index(self)


class Origin(StrEnum):
    """How the deployment came to this schema."""

    CLEAN_INSTALL = "clean_install"
    LEGACY_ADOPTION = "legacy_adoption"


@dataclass(frozen=True)
class DeploymentControl:
    """The decoded control record."""

    generation: int
    phase: Phase
    origin: Origin
    default_new_run_owner: ExecutionOwner
    v2_admission_enabled: bool
    isolated_single_org: bool
    deployment_org_id: str | None
    quarantine_reason: str | None
    drain_started_at: datetime | None
    drained_at: datetime | None
    drain_evidence: Mapping[str, Any] | None
    org_backfill_receipt_id: str | None
    org_schema_verified_at: datetime | None
    write_protocol_enabled_at: datetime | None
    admission_changed_at: datetime | None
    state_version: int
    updated_at: datetime

    @property
    def quarantined(self) -> bool:
        return self.quarantine_reason is not None

    @property
    def gates_passed(self) -> bool:
        """Both gates passed and ``FlowInterviewWriteProtocolGeneration >= 1``."""
        return (
            self.generation >= 1
            and self.phase is Phase.WRITE_PROTOCOL_ENABLED
            and not self.quarantined
        )

    def to_dict(self) -> dict[str, Any]:
        """Evidence form (times ISO, enums by value)."""

        def t(v: datetime | None) -> str | None:
            return None if v is None else v.isoformat()

        return {
            "write_protocol_generation": self.generation,
            "phase": self.phase.value,
            "origin": self.origin.value,
            "default_new_run_owner": self.default_new_run_owner.code,
            "v2_admission_enabled": self.v2_admission_enabled,
            "isolated_single_org": self.isolated_single_org,
            "deployment_org_id": self.deployment_org_id,
            "quarantine_reason": self.quarantine_reason,
            "drain_started_at": t(self.drain_started_at),
            "drained_at": t(self.drained_at),
            "drain_evidence": self.drain_evidence,
            "org_backfill_receipt_id": self.org_backfill_receipt_id,
            "org_schema_verified_at": t(self.org_schema_verified_at),
            "write_protocol_enabled_at": t(self.write_protocol_enabled_at),
            "admission_changed_at": t(self.admission_changed_at),
            "state_version": self.state_version,
        }

    @classmethod
    def from_row(cls, r: Any) -> DeploymentControl:
        evidence = r["drain_evidence"]
        return cls(
            generation=int(r["write_protocol_generation"]),
            phase=Phase(r["phase"]),
            origin=Origin(r["origin"]),
            default_new_run_owner=ExecutionOwner.from_code(r["default_new_run_owner"]),
            v2_admission_enabled=bool(r["v2_admission_enabled"]),
            isolated_single_org=bool(r["isolated_single_org"]),
            deployment_org_id=r["deployment_org_id"],
            quarantine_reason=r["quarantine_reason"],
            drain_started_at=r["drain_started_at"],
            drained_at=r["drained_at"],
            drain_evidence=None if evidence is None else json.loads(evidence),
            org_backfill_receipt_id=r["org_backfill_receipt_id"],
            org_schema_verified_at=r["org_schema_verified_at"],
            write_protocol_enabled_at=r["write_protocol_enabled_at"],
            admission_changed_at=r["admission_changed_at"],
            state_version=int(r["state_version"]),
            updated_at=r["updated_at"],
        )


def _missing() -> FailedPreconditionError:
    return FailedPreconditionError(
        "the deployment control record is missing; run `db upgrade`",
        reason="deployment_control_missing",
    )


#: The control record's plain read, built once (it runs in every step's transaction).
_READ_CONTROL = select(flow_deployment_control).where(
    flow_deployment_control.c.control_key == CONTROL_KEY
)


async def read_control_txn(conn: AsyncConnection) -> DeploymentControl:
    """The control record (a plain read inside the caller's transaction).

    Raises:
        FailedPreconditionError: the record is missing (fail closed).
    """
    row = (await conn.execute(_READ_CONTROL)).mappings().first()
    if row is None:
        raise _missing()
    return DeploymentControl.from_row(row)


async def lock_control_txn(conn: AsyncConnection) -> DeploymentControl:
    """The control record, locked ``FOR UPDATE`` until the caller's transaction ends."""
    t = flow_deployment_control.c
    stmt = select(flow_deployment_control).where(t.control_key == CONTROL_KEY).with_for_update()
    row = (await conn.execute(stmt)).mappings().first()
    if row is None:
        raise _missing()
    return DeploymentControl.from_row(row)


def _encode(values: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(values)
    if "drain_evidence" in out and out["drain_evidence"] is not None:
        out["drain_evidence"] = json.dumps(out["drain_evidence"], sort_keys=True)
    for key in ("default_new_run_owner",):
        if isinstance(out.get(key), ExecutionOwner):
            out[key] = out[key].code
    for key in ("phase", "origin"):
        if isinstance(out.get(key), StrEnum):
            out[key] = out[key].value
    return out


async def update_control_txn(
    conn: AsyncConnection, expected_version: int, values: Mapping[str, Any], now: datetime
) -> int:
    """Compare-and-swap the control record; returns the new version.

    Raises:
        FenceLostError: another operator changed the record since it was read.
    """
    t = flow_deployment_control.c
    result = await conn.execute(
        update(flow_deployment_control)
        .where(t.control_key == CONTROL_KEY, t.state_version == expected_version)
        .values({**_encode(values), "updated_at": now, "state_version": t.state_version + 1})
    )
    if result.rowcount != 1:
        raise FenceLostError("flow_deployment_control", CONTROL_KEY, expected_version, None)
    return expected_version + 1
