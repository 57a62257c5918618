"""Legacy-owned ``flow_runs`` rows and the pure decisions of every legacy mutator.

Every legacy write is decided here from a row *locked by* ``(OrgID, FlowRunId)`` and
applied by :mod:`runtime_svc.legacy.store` as a compare-and-swap whose SQL predicate
repeats the decision's premises (§20.3 7-8: the locked-row recheck of trusted org,
status, execution owner, ownership epoch and state version, then the
org/owner/epoch/state-version predicate). A V2-owned row — even one whose compatibility
projection reads ``Paused`` — is rejected here before any SQL is written, and could not
be matched by the predicate anyway.

A legacy transition may change only :data:`LEGACY_MUTABLE_FIELDS` (§10.1 "may update only
the legacy-owned field set"); the canonical ``runtime_state`` of a legacy row is derived
from the legacy status in the same write, so readers of either vocabulary agree.

Pure: no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from runtime_svc.kernel.states import CompatibilityStatus, ExecutionOwner, RunState
from runtime_svc.legacy.interpreter import Failed, Finished, Paused, Segment, StillWaiting
from runtime_svc.legacy.state import LegacyState
from services.auth import TrustedRuntimeWorkScope
from services.invariants import InvariantError

__all__ = [
    "CANCELLED_CAUSE",
    "LEGACY_EPOCH",
    "LEGACY_MUTABLE_FIELDS",
    "LEGACY_OWNER",
    "LEGACY_PROFILE",
    "LEGACY_QUEUE",
    "LegacyClaim",
    "LegacyInterview",
    "Rejected",
    "Rejection",
    "decide_cancel",
    "decide_claim",
    "decide_commit",
    "decide_delete",
    "decide_stale_recovery",
    "legacy_runtime_state",
    "recheck",
]

#: The storage code of the legacy owner and its one epoch (§20.6).
LEGACY_OWNER = ExecutionOwner.LEGACY_INTERPRETER.code
LEGACY_EPOCH = 0
#: ``execution_profile`` / ``queue_class`` of a legacy run: not one of the §9 profiles.
LEGACY_PROFILE = "legacy_interpreter"
LEGACY_QUEUE = "legacy_interpreter"
#: Safe terminal cause of a cancelled/deleted legacy interview.
CANCELLED_CAUSE = "cancelled"

#: The legacy-owned field set: the only columns a legacy transition writes.
LEGACY_MUTABLE_FIELDS = frozenset(
    {
        "interview_status",
        "runtime_state",
        "current_element",
        "paused_at",
        "run_after",
        "legacy_context",
        "legacy_claimed_by",
        "legacy_claim_until",
        "terminal_cause_code",
        "is_deleted",
        "delete_requested_at",
        "started_at",
        "completed_at",
        "updated_at",
    }
)

_S = CompatibilityStatus


def legacy_runtime_state(status: CompatibilityStatus, *, cause: str | None = None) -> RunState:
    """The canonical state a legacy status stands for (the inverse of §18.2)."""
    if status is _S.RUNNING:
        return RunState.RUNNING
    if status is _S.PAUSED:
        return RunState.WAITING
    if status is _S.FINISHED:
        return RunState.SUCCEEDED
    if cause == CANCELLED_CAUSE:
        return RunState.CANCELLED
    if cause == "wait_quarantined":
        return RunState.QUARANTINED
    return RunState.TERMINAL_FAILED


@dataclass(frozen=True)
class LegacyInterview:
    """One ``flow_runs`` row as the legacy interpreter sees it."""

    scope: TrustedRuntimeWorkScope
    flow_run_id: str
    flow_version_id: str
    execution_owner: str
    ownership_epoch: int
    state_version: int
    status: CompatibilityStatus
    runtime_state: str
    current_element: str | None
    paused_at: datetime | None
    run_after: datetime | None
    context: str | None
    claimed_by: str | None
    claim_until: datetime | None
    terminal_cause_code: str | None
    is_deleted: bool
    delete_requested_at: datetime | None
    started_at: datetime | None
    completed_at: datetime | None
    idempotency_key: str | None
    request_digest: str | None
    created_at: datetime
    updated_at: datetime

    @property
    def org_id(self) -> str:
        return self.scope.org_id

    @property
    def terminal(self) -> bool:
        return self.status in (_S.FINISHED, _S.ERROR)

    def state(self) -> LegacyState:
        """The decoded interview context.

        Raises:
            ValueError: the row carries no legacy context (not a legacy interview).
        """
        if self.context is None:
            raise ValueError("the run carries no legacy interview context")
        return LegacyState.loads(self.context)

    def outputs(self) -> Mapping[str, Any] | None:
        """Declared outputs of a finished interview (``None`` otherwise)."""
        if self.status is not _S.FINISHED or self.context is None:
            return None
        out = json.loads(self.context).get("output")
        return out if isinstance(out, dict) else None

    @classmethod
    def from_row(cls, r: Any) -> LegacyInterview:
        """Decode a ``flow_runs`` row mapping."""
        return cls(
            scope=TrustedRuntimeWorkScope(
                r["org_id"],
                r["app_installation_id"],
                r["runtime_capability_id"],
                r["runtime_work_binding_digest"],
            ),
            flow_run_id=r["flow_run_id"],
            flow_version_id=r["flow_version_id"],
            execution_owner=r["execution_owner"],
            ownership_epoch=int(r["ownership_epoch"]),
            state_version=int(r["state_version"]),
            status=CompatibilityStatus.from_code(r["interview_status"]),
            runtime_state=r["runtime_state"],
            current_element=r["current_element"],
            paused_at=r["paused_at"],
            run_after=r["run_after"],
            context=r["legacy_context"],
            claimed_by=r["legacy_claimed_by"],
            claim_until=r["legacy_claim_until"],
            terminal_cause_code=r["terminal_cause_code"],
            is_deleted=bool(r["is_deleted"]),
            delete_requested_at=r["delete_requested_at"],
            started_at=r["started_at"],
            completed_at=r["completed_at"],
            idempotency_key=r["idempotency_key"],
            request_digest=r["request_digest"],
            created_at=r["created_at"],
            updated_at=r["updated_at"],
        )


class Rejection(StrEnum):
    """Why a legacy mutator refused a row (a value, not an exception)."""

    NOT_FOUND = "not_found"
    NOT_LEGACY_OWNED = "not_legacy_owned"
    EPOCH_MISMATCH = "epoch_mismatch"
    VERSION_MISMATCH = "state_version_mismatch"
    DELETED = "deleted"
    STATUS = "status"
    NOT_DUE = "not_due"
    CLAIM_MISMATCH = "claim_mismatch"
    CLAIM_LIVE = "claim_live"


@dataclass(frozen=True)
class Rejected:
    """A refused legacy transition."""

    reason: Rejection


@dataclass(frozen=True)
class LegacyClaim:
    """A won legacy claim: the fence of the segment that follows (``token`` is unique
    per claim, ``state_version`` the row version the claim wrote)."""

    scope: TrustedRuntimeWorkScope
    flow_run_id: str
    flow_version_id: str
    state_version: int
    token: str
    context: str

    @property
    def org_id(self) -> str:
        return self.scope.org_id


def recheck(
    row: LegacyInterview | None,
    *,
    org_id: str,
    expected_version: int | None,
    statuses: frozenset[CompatibilityStatus] | None = None,
    allow_deleted: bool = False,
) -> Rejected | None:
    """The §20.3 locked-row recheck shared by every legacy mutator."""
    if row is None or row.org_id != org_id:
        return Rejected(Rejection.NOT_FOUND)
    if row.execution_owner != LEGACY_OWNER:
        return Rejected(Rejection.NOT_LEGACY_OWNED)
    if row.ownership_epoch != LEGACY_EPOCH:
        return Rejected(Rejection.EPOCH_MISMATCH)
    if expected_version is not None and row.state_version != expected_version:
        return Rejected(Rejection.VERSION_MISMATCH)
    if row.is_deleted and not allow_deleted:
        return Rejected(Rejection.DELETED)
    if statuses is not None and row.status not in statuses:
        return Rejected(Rejection.STATUS)
    return None


def _claim_values(token: str, until: datetime, now: datetime) -> dict[str, Any]:
    return {
        "interview_status": _S.RUNNING.code,
        "runtime_state": legacy_runtime_state(_S.RUNNING).code,
        "legacy_claimed_by": token,
        "legacy_claim_until": until,
        "updated_at": now,
    }


def decide_claim(
    row: LegacyInterview | None,
    *,
    org_id: str,
    expected_version: int | None,
    token: str,
    now: datetime,
    lease: timedelta,
    require_due: bool,
) -> Rejected | dict[str, Any]:
    """``ClaimPausedInterview``: a due (or, for a direct resume, any) Paused legacy row."""
    refused = recheck(
        row, org_id=org_id, expected_version=expected_version, statuses=frozenset({_S.PAUSED})
    )
    if refused is not None:
        return refused
    if row is None:
        raise InvariantError("broken invariant: row is not None")
    if require_due and (row.run_after is None or row.run_after > now):
        return Rejected(Rejection.NOT_DUE)
    values = _claim_values(token, now + lease, now)
    if row.started_at is None:
        values["started_at"] = now
    return values


def decide_commit(
    row: LegacyInterview | None, claim: LegacyClaim, segment: Segment, now: datetime
) -> Rejected | dict[str, Any]:
    """The end of a claimed segment: Paused, Finished or Error, claim released."""
    refused = recheck(
        row,
        org_id=claim.org_id,
        expected_version=claim.state_version,
        statuses=frozenset({_S.RUNNING}),
    )
    if refused is not None:
        return refused
    if row is None:
        raise InvariantError("broken invariant: row is not None")
    if row.claimed_by != claim.token:
        return Rejected(Rejection.CLAIM_MISMATCH)
    status = segment.status
    state = segment.state
    values: dict[str, Any] = {
        "legacy_context": state.dumps(),
        "legacy_claimed_by": None,
        "legacy_claim_until": None,
        "updated_at": now,
    }
    if isinstance(status, Paused | StillWaiting):
        values |= {
            "interview_status": _S.PAUSED.code,
            "runtime_state": legacy_runtime_state(_S.PAUSED).code,
            "current_element": status.wait.element,
            "paused_at": now if row.status is not _S.PAUSED else row.paused_at,
            "run_after": status.wait.run_after,
        }
        if isinstance(status, StillWaiting) and row.paused_at is not None:
            values["paused_at"] = row.paused_at
    elif isinstance(status, Finished):
        values |= {
            "interview_status": _S.FINISHED.code,
            "runtime_state": legacy_runtime_state(_S.FINISHED).code,
            "current_element": None,
            "run_after": None,
            "completed_at": now,
        }
    else:
        if not isinstance(status, Failed):
            raise InvariantError("broken invariant: isinstance(status, Failed)")
        cause = "wait_quarantined" if status.quarantined else status.code[:32]
        values |= {
            "interview_status": _S.ERROR.code,
            "runtime_state": legacy_runtime_state(_S.ERROR, cause=cause).code,
            "current_element": status.element,
            "run_after": None,
            "terminal_cause_code": cause,
            "completed_at": now,
        }
    return values


def decide_stale_recovery(
    row: LegacyInterview | None, *, org_id: str, now: datetime
) -> Rejected | dict[str, Any]:
    """Stale-claim recovery: a Running legacy row whose claim expired goes back to
    Paused, due now, at its last committed position (the segment re-runs from there)."""
    refused = recheck(
        row,
        org_id=org_id,
        expected_version=None,
        statuses=frozenset({_S.RUNNING}),
        allow_deleted=True,
    )
    if refused is not None:
        return refused
    if row is None:
        raise InvariantError("broken invariant: row is not None")
    if row.claim_until is not None and row.claim_until > now:
        return Rejected(Rejection.CLAIM_LIVE)
    return {
        "interview_status": _S.PAUSED.code,
        "runtime_state": legacy_runtime_state(_S.PAUSED).code,
        "legacy_claimed_by": None,
        "legacy_claim_until": None,
        "paused_at": now,
        "run_after": now,
        "updated_at": now,
    }


def _cancel_values(row: LegacyInterview, now: datetime) -> dict[str, Any]:
    return {
        "interview_status": _S.ERROR.code,
        "runtime_state": legacy_runtime_state(_S.ERROR, cause=CANCELLED_CAUSE).code,
        "terminal_cause_code": CANCELLED_CAUSE,
        "legacy_claimed_by": None,
        "legacy_claim_until": None,
        "run_after": None,
        "completed_at": now,
        "updated_at": now,
        "delete_requested_at": row.delete_requested_at or now,
    }


def decide_delete(
    row: LegacyInterview | None, *, org_id: str, expected_version: int | None, now: datetime
) -> Rejected | dict[str, Any] | None:
    """The §10.1 ``DeleteFlowInterview`` on a legacy row: a non-terminal interview is
    cancelled and tombstoned (``IsDeleted``) in one fenced write; a terminal one only
    gains the soft-delete fact; an already deleted one is unchanged (``None``)."""
    refused = recheck(row, org_id=org_id, expected_version=None, allow_deleted=True)
    if refused is not None:
        return refused
    if row is None:
        raise InvariantError("broken invariant: row is not None")
    if row.is_deleted:
        return None
    if expected_version and row.state_version != expected_version:
        return Rejected(Rejection.VERSION_MISMATCH)
    if row.terminal:
        return {"is_deleted": True, "delete_requested_at": now, "updated_at": now}
    return {**_cancel_values(row, now), "is_deleted": True}


def decide_cancel(
    row: LegacyInterview | None, *, org_id: str, expected_version: int | None, now: datetime
) -> Rejected | dict[str, Any] | None:
    """Cancel a non-terminal legacy interview (``None``: already cancelled)."""
    refused = recheck(row, org_id=org_id, expected_version=None)
    if refused is not None:
        return refused
    if row is None:
        raise InvariantError("broken invariant: row is not None")
    if row.terminal:
        return None if row.terminal_cause_code == CANCELLED_CAUSE else Rejected(Rejection.STATUS)
    if expected_version and row.state_version != expected_version:
        return Rejected(Rejection.VERSION_MISMATCH)
    return _cancel_values(row, now)
