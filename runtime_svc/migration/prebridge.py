"""Reads of the pre-bridge FlowInterview shape (``flow_interviews``) — the one ID-only
path this runtime has, and the gate that closes it.

§20.2: "Before final tightening, ID-only legacy reads/claims may exist only in the current
physically isolated single-org deployment, with V2 and pooled serving disabled." So a
read by ``interview_id`` alone is served only while the control record says the
deployment is in the additive window (generation 0, before the org-schema gate) *and*
isolated single-org; at and after the org-schema gate every such call fails closed with
:class:`IdOnlyPathClosedError` — the rows have been adopted into the org-keyed
``flow_runs`` and are read there by ``(OrgID, FlowRunId)`` only.

The bridge binary never writes this table outside :mod:`runtime_svc.migration.backfill`
(stamping, adoption); pre-bridge binaries are its only application writers.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.kernel.model import RunRecord
from runtime_svc.kernel.states import CompatibilityStatus, ExecutionOwner, RunState
from runtime_svc.legacy.model import LEGACY_PROFILE, LEGACY_QUEUE, legacy_runtime_state
from runtime_svc.migration.control import DeploymentControl, Phase, read_control_txn
from runtime_svc.schema_bridge import flow_interviews
from services.db import transaction
from services.errors import FailedPreconditionError, NotFoundError

__all__ = [
    "IdOnlyPathClosedError",
    "PreBridgeInterview",
    "id_only_path_open",
    "read_prebridge_interview",
]


class IdOnlyPathClosedError(FailedPreconditionError):
    """An ID-only FlowInterview path was called outside the isolated pre-bridge window."""

    def __init__(self, what: str) -> None:
        super().__init__(
            f"ID-only FlowInterview {what} is closed: the deployment is past the "
            "org-schema gate or not an isolated single-org deployment",
            reason="id_only_path_closed",
        )


def id_only_path_open(control: DeploymentControl) -> bool:
    """Whether an ID-only pre-bridge read may be served (see the module docstring)."""
    return (
        control.generation == 0
        and control.isolated_single_org
        and control.phase.rank < Phase.ORG_SCHEMA_VERIFIED.rank
        and not control.v2_admission_enabled
    )


@dataclass(frozen=True)
class PreBridgeInterview:
    """One ``flow_interviews`` row."""

    interview_id: str
    org_id: str | None
    flow_api_name: str
    flow_version_number: int
    status: str
    current_element: str | None
    paused_at: datetime | None
    resume_at: datetime | None
    context_payload: str
    is_deleted: bool
    execution_owner: str
    ownership_epoch: int
    state_version: int
    delete_requested_at: datetime | None
    adopted_at: datetime | None
    created_at: datetime
    updated_at: datetime

    @classmethod
    def from_row(cls, r: Any) -> PreBridgeInterview:
        return cls(
            interview_id=r["interview_id"],
            org_id=r["org_id"],
            flow_api_name=r["flow_api_name"],
            flow_version_number=int(r["flow_version_number"]),
            status=r["interview_status"],
            current_element=r["current_element"],
            paused_at=r["paused_at"],
            resume_at=r["resume_at"],
            context_payload=r["context_payload"],
            is_deleted=bool(r["is_deleted"]),
            execution_owner=r["execution_owner"],
            ownership_epoch=int(r["ownership_epoch"]),
            state_version=int(r["state_version"]),
            delete_requested_at=r["delete_requested_at"],
            adopted_at=r["adopted_at"],
            created_at=r["created_at"],
            updated_at=r["updated_at"],
        )

    def run_record(self, org_id: str) -> RunRecord:
        """The compatibility projection of this row as a run of ``org_id`` (pre-gate
        reads by existing clients; the work-scope fields are unknown before adoption)."""
        status = CompatibilityStatus.from_code(self.status)
        state: RunState = legacy_runtime_state(status)
        return RunRecord(
            org_id=org_id,
            flow_run_id=self.interview_id,
            app_installation_id="",
            runtime_capability_id="",
            runtime_work_binding_digest="",
            flow_version_id="",
            plan_id="",
            execution_profile=LEGACY_PROFILE,
            execution_owner=ExecutionOwner.from_code(self.execution_owner),
            state=state,
            state_version=self.state_version,
            ownership_epoch=self.ownership_epoch,
            current_step_execution_id=None,
            current_checkpoint_id=None,
            run_after=self.resume_at,
            queue_class=LEGACY_QUEUE,
            priority=0,
            terminal_cause_code=None,
            is_deleted=self.is_deleted,
            delete_requested_at=self.delete_requested_at,
            started_at=None,
            completed_at=None,
            idempotency_key=None,
            request_digest=None,
            interview_status=self.status,
            current_element=self.current_element,
            paused_at=self.paused_at,
            created_at=self.created_at,
            updated_at=self.updated_at,
        )


async def _read_txn(conn: AsyncConnection, interview_id: str) -> PreBridgeInterview | None:
    t = flow_interviews.c
    row = (
        (await conn.execute(select(flow_interviews).where(t.interview_id == interview_id)))
        .mappings()
        .first()
    )
    return None if row is None else PreBridgeInterview.from_row(row)


async def read_prebridge_interview(
    engine: AsyncEngine, trusted_org_id: str, interview_id: str
) -> PreBridgeInterview:
    """ID-only read of a pre-bridge interview for the caller's trusted org.

    Served only inside the isolated pre-bridge window; a stamped row of another org, an
    adopted row and a deleted row answer like a missing one.

    Raises:
        IdOnlyPathClosedError: outside the window (fail closed).
        NotFoundError: missing, foreign, adopted or deleted.
    """
    async with transaction(engine, readonly=True) as conn:
        control = await read_control_txn(conn)
        if not id_only_path_open(control):
            raise IdOnlyPathClosedError("read")
        row = await _read_txn(conn, interview_id)
    if (
        row is None
        or row.adopted_at is not None
        or row.is_deleted
        or (row.org_id is not None and row.org_id != trusted_org_id)
    ):
        raise NotFoundError("flow_run", interview_id)
    return row
