"""Operator pause/resume and restart from a checkpoint against the database (issue 14
item 5; part of the state store).

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

:func:`restart_run_txn` (``RestartFromCheckpoint``) is an ordinary fenced transition
(``apply_transition``: the root's conditional UPDATE *with* a version bump, the new step's
insert) over the operator-only arrow ``TerminalFailed -> Runnable``.

The quarantine retry (``RetryQuarantinedRun``) is
:func:`runtime_svc.kernel.store_reconcile.reconcile_quarantine_txn`, shared with
``python -m runtime_svc.ops``.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import false, func, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from runtime_svc.compiler.kinds import EFFECT_COMPLETION_PRODUCER
from runtime_svc.kernel.decisions import RUNS
from runtime_svc.kernel.errors import StateVersionMismatchError, fence_lost
from runtime_svc.kernel.model import RunRecord, StepRecord
from runtime_svc.kernel.states import ExecutionOwner, StepState
from runtime_svc.kernel.store_codec import step_from_row
from runtime_svc.kernel.store_reads import get_checkpoint_txn
from runtime_svc.kernel.store_rows import apply_transition, lock_run, lock_step, new_id
from runtime_svc.kernel.tables import compatibility_status
from runtime_svc.kernel.transitions_operator import (
    OperatorNoChange,
    OperatorRefused,
    PauseChange,
    Restart,
    decide_pause,
    decide_restart,
    decide_resume,
)
from runtime_svc.kernel.wait_model import DependencyState
from runtime_svc.schema import (
    audit_records,
    flow_dependencies,
    flow_runs,
    flow_step_executions,
)
from services.db import db_now
from services.digest import canonical_json
from services.errors import FailedPreconditionError, FenceLostError, NotFoundError

__all__ = [
    "OPERATOR_ACTOR_KIND",
    "OperatorActor",
    "insert_operator_audit_txn",
    "pause_run_txn",
    "restart_run_txn",
    "resume_run_txn",
    "unknown_effects_txn",
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


async def unknown_effects_txn(conn: AsyncConnection, org_id: str, flow_run_id: str) -> int:
    """Effect-completion dependencies of the run whose owner outcome is not known yet
    (``Pending``) or ambiguous (``Quarantined``): a retry or restart could repeat their
    effect. Read under the root lock, which every dependency transition takes first."""
    d = flow_dependencies.c
    stmt = (
        select(func.count())
        .select_from(flow_dependencies)
        .where(
            d.org_id == org_id,
            d.flow_run_id == flow_run_id,
            d.producer_kind == EFFECT_COMPLETION_PRODUCER,
            d.state.in_([DependencyState.PENDING.code, DependencyState.QUARANTINED.code]),
        )
    )
    return int((await conn.execute(stmt)).scalar_one())


async def _consumer_of(
    conn: AsyncConnection, org_id: str, flow_run_id: str, checkpoint_id: str
) -> tuple[StepRecord | None, int]:
    """The first step execution of the run that took ``checkpoint_id`` as input, and the
    next invocation ordinal of its plan step (read under the root lock)."""
    s = flow_step_executions.c
    row = (
        (
            await conn.execute(
                select(flow_step_executions)
                .where(
                    s.org_id == org_id,
                    s.flow_run_id == flow_run_id,
                    s.input_checkpoint_id == checkpoint_id,
                )
                .order_by(s.created_at, s.invocation_ordinal, s.step_execution_id)
                .limit(1)
            )
        )
        .mappings()
        .first()
    )
    if row is None:
        return None, 0
    source = step_from_row(row)
    last = (
        await conn.execute(
            select(func.max(s.invocation_ordinal)).where(
                s.org_id == org_id,
                s.flow_run_id == flow_run_id,
                s.plan_step_key == source.plan_step_key,
            )
        )
    ).scalar_one()
    return source, 0 if last is None else int(last) + 1


async def restart_run_txn(
    conn: AsyncConnection,
    org_id: str,
    flow_run_id: str,
    checkpoint_id: str,
    actor: OperatorActor,
    *,
    reason: str,
    expected_state_version: int | None = None,
) -> Restart:
    """Restart a failed run from one of its checkpoints
    (:func:`~runtime_svc.kernel.transitions_operator.decide_restart`): root first, then
    the checkpoint and its consumer step read under the root lock, the fenced root
    UPDATE plus the new step's insert (``apply_transition``), and the audit record.

    Raises:
        NotFoundError: run missing, foreign or deleted; checkpoint missing, foreign or
            of another run.
        StateVersionMismatchError: the root is not at ``expected_state_version``.
        FailedPreconditionError: ``run_quarantined``, ``run_not_failed``,
            ``checkpoint_not_a_step_input``, ``effect_outcome_unknown``,
            ``legacy_owned_run`` — nothing written.
    """
    root, _ = await _locked_root(conn, org_id, flow_run_id, expected_state_version)
    await get_checkpoint_txn(conn, org_id, flow_run_id, checkpoint_id)
    source, ordinal = await _consumer_of(conn, org_id, flow_run_id, checkpoint_id)
    now = await db_now(conn)
    decision = decide_restart(
        root,
        checkpoint_id,
        source,
        new_step_execution_id=new_id("step"),
        invocation_ordinal=ordinal,
        now=now,
    )
    if isinstance(decision, OperatorRefused):
        raise _refuse(decision, "restart", flow_run_id)
    if await unknown_effects_txn(conn, org_id, flow_run_id):
        raise FailedPreconditionError(
            f"cannot restart run {flow_run_id}: an effect of the run has no known owner "
            "outcome (pending or ambiguous); reconcile it with the effect owner first",
            reason="effect_outcome_unknown",
        )
    try:
        await apply_transition(conn, org_id, decision.transition, now)
    except FenceLostError as exc:
        if expected_state_version is None:
            raise
        raise StateVersionMismatchError(expected_state_version, exc.found_version) from exc
    await insert_operator_audit_txn(
        conn,
        org_id,
        actor,
        "flow_run.restart",
        root,
        {
            "checkpoint_id": checkpoint_id,
            "source_step_execution_id": decision.source_step_execution_id,
            "failed_step_execution_id": root.current_step_execution_id,
            "terminal_cause_code": root.terminal_cause_code,
            "reason": reason,
        },
        step_execution_id=decision.step_execution_id,
    )
    return decision
