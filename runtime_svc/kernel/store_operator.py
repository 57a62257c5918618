"""Operator pause/resume against the database (issue 14 item 5; part of the state store).

Each function runs in the caller's transaction (``PauseRun``/``ResumeRun`` put the
request-ledger row in the same one): lock the root first (§12 order; nothing else is
locked — the pause touches the root row only), ask the pure
:mod:`runtime_svc.kernel.transitions_operator` decision, then apply it as one
conditional UPDATE whose row count must be 1 — compared on the root's
``state_version``, ``runtime_state``, owner, epoch, liveness and the pause flag, but
**without a version bump**, so a worker already running the current step keeps its root
fence (the heartbeat's shape, ``store_rows.extend_lease_row``). The same transaction
recomputes the §18.2 projection (a paused active run is ``Paused``) and appends one
audit record naming the caller.

The quarantine retry (``RetryQuarantinedRun``) is
:func:`runtime_svc.kernel.store_reconcile.reconcile_quarantine_txn`, shared with
``python -m runtime_svc.ops``.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import false, update
from sqlalchemy.ext.asyncio import AsyncConnection

from runtime_svc.kernel.decisions import RUNS
from runtime_svc.kernel.errors import StateVersionMismatchError, fence_lost
from runtime_svc.kernel.model import RunRecord
from runtime_svc.kernel.states import ExecutionOwner, StepState
from runtime_svc.kernel.store_rows import lock_run, lock_step
from runtime_svc.kernel.tables import compatibility_status
from runtime_svc.kernel.transitions_operator import (
    OperatorNoChange,
    OperatorRefused,
    PauseChange,
    decide_pause,
    decide_resume,
)
from runtime_svc.schema import audit_records, flow_runs
from services.db import db_now
from services.digest import canonical_json
from services.errors import FailedPreconditionError, NotFoundError

__all__ = [
    "OPERATOR_ACTOR_KIND",
    "OperatorActor",
    "insert_operator_audit_txn",
    "pause_run_txn",
    "resume_run_txn",
]

#: ``audit_records.actor_kind`` of an operator decision (also the ops CLI's).
OPERATOR_ACTOR_KIND = "operator"
_MAX_ACTOR = 128  # audit_records.actor_id


@dataclass(frozen=True)
class OperatorActor:
    """Who decided, as the audit record keeps it: the verified credential's subject and
    signing key (never the credential itself), or the ops CLI's ``--operator``."""

    actor_id: str
    key_id: str = ""


async def insert_operator_audit_txn(
    conn: AsyncConnection,
    org_id: str,
    actor: OperatorActor,
    action: str,
    root: RunRecord,
    details: Mapping[str, Any],
    *,
    step_execution_id: str | None = None,
    attempt_id: str | None = None,
) -> None:
    """Append the audit record of one operator decision on ``root`` (safe details only)."""
    await conn.execute(
        audit_records.insert().values(
            org_id=org_id,
            audit_record_id=f"aud_{uuid.uuid4().hex}",
            actor_kind=OPERATOR_ACTOR_KIND,
            actor_id=actor.actor_id[:_MAX_ACTOR],
            action=action,
            flow_run_id=root.flow_run_id,
            step_execution_id=step_execution_id,
            attempt_id=attempt_id,
            details=canonical_json(
                {
                    **details,
                    **({"key_id": actor.key_id} if actor.key_id else {}),
                    "runtime_state": root.state.code,
                    "state_version": root.state_version,
                }
            ).decode("utf-8"),
            occurred_at=await db_now(conn),
        )
    )


async def _locked_root(
    conn: AsyncConnection, org_id: str, flow_run_id: str, expected: int | None
) -> tuple[RunRecord, StepState | None]:
    """Lock the root, then its current step (§12 order; the step is read for the §18.2
    projection only)."""
    root = await lock_run(conn, org_id, flow_run_id)
    if root is None or root.is_deleted:
        raise NotFoundError("flow_run", flow_run_id)
    if expected is not None and root.state_version != expected:
        raise StateVersionMismatchError(expected, root.state_version)
    step_id = root.current_step_execution_id
    step = None if step_id is None else await lock_step(conn, org_id, step_id)
    return root, None if step is None else step.state


async def _apply_pause(
    conn: AsyncConnection,
    org_id: str,
    change: PauseChange,
    step_state: StepState | None,
    expected: int | None,
) -> None:
    t = flow_runs.c
    pausing = change.paused_at is not None
    status = compatibility_status(change.state, step_state, paused=pausing)
    stmt = (
        update(flow_runs)
        .where(
            t.org_id == org_id,
            t.flow_run_id == change.flow_run_id,
            t.state_version == change.expected_version,
            t.runtime_state == change.state.code,
            t.execution_owner == ExecutionOwner.FLOW_RUNTIME_V2.code,
            t.ownership_epoch == change.epoch,
            t.is_deleted == false(),
            t.delete_requested_at.is_(None),
            t.operator_paused_at.is_(None) if pausing else t.operator_paused_at.is_not(None),
        )
        .values(
            operator_paused_at=change.paused_at,
            interview_status=status.code,
            updated_at=await db_now(conn),
        )
    )
    if (await conn.execute(stmt)).rowcount != 1:
        if expected is not None:
            raise StateVersionMismatchError(expected, None)
        raise fence_lost(RUNS, change.flow_run_id, change.expected_version, None, "pause")


def _refuse(decision: OperatorRefused, action: str, flow_run_id: str) -> FailedPreconditionError:
    return FailedPreconditionError(
        f"cannot {action} run {flow_run_id}: {decision.reason}", reason=decision.reason
    )


async def pause_run_txn(
    conn: AsyncConnection,
    org_id: str,
    flow_run_id: str,
    actor: OperatorActor,
    *,
    expected_state_version: int | None = None,
    reason: str = "",
) -> PauseChange | OperatorNoChange:
    """Pause the run (:func:`~runtime_svc.kernel.transitions_operator.decide_pause`).

    Raises:
        NotFoundError: missing, foreign or deleted.
        StateVersionMismatchError: the root is not at ``expected_state_version``.
        FailedPreconditionError: ``run_terminal``, ``run_cancelling``,
            ``legacy_owned_run`` — nothing written.
    """
    root, step_state = await _locked_root(conn, org_id, flow_run_id, expected_state_version)
    decision = decide_pause(root, await db_now(conn))
    if isinstance(decision, OperatorRefused):
        raise _refuse(decision, "pause", flow_run_id)
    if isinstance(decision, PauseChange):
        await _apply_pause(conn, org_id, decision, step_state, expected_state_version)
        details = {"reason": reason} if reason else {}
        await insert_operator_audit_txn(conn, org_id, actor, "flow_run.pause", root, details)
    return decision


async def resume_run_txn(
    conn: AsyncConnection,
    org_id: str,
    flow_run_id: str,
    actor: OperatorActor,
    *,
    expected_state_version: int | None = None,
    reason: str = "",
) -> PauseChange | OperatorNoChange:
    """Resume the run (:func:`~runtime_svc.kernel.transitions_operator.decide_resume`).

    Raises:
        NotFoundError: missing, foreign or deleted.
        StateVersionMismatchError: the root is not at ``expected_state_version``.
        FailedPreconditionError: ``legacy_owned_run`` — nothing written.
    """
    root, step_state = await _locked_root(conn, org_id, flow_run_id, expected_state_version)
    decision = decide_resume(root)
    if isinstance(decision, OperatorRefused):
        raise _refuse(decision, "resume", flow_run_id)
    if isinstance(decision, PauseChange):
        await _apply_pause(conn, org_id, decision, step_state, expected_state_version)
        details = {"reason": reason} if reason else {}
        await insert_operator_audit_txn(conn, org_id, actor, "flow_run.resume", root, details)
    return decision
