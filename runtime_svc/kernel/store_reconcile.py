"""The operator's reconciliation of a commit-unknown quarantine, against the database.

:func:`inspect_quarantine` reads the marker (no locks, no writes);
:func:`reconcile_quarantine` locks root, step and latest attempt in the §12 order, reads
the marker again under those locks, asks :func:`runtime_svc.kernel.reconcile.decide_reconcile`,
and applies the decision as conditional UPDATEs of root and step (row count 1 each, on
their state versions and the ``Quarantined`` state) plus one audit record of the
decision — one transaction. See :mod:`runtime_svc.kernel.reconcile` for the semantics;
operators run it through ``python -m runtime_svc.ops quarantine …`` or, for ``retry``,
the fenced, role-checked ``FlowRunService.RetryQuarantinedRun`` — both call
:func:`reconcile_quarantine_txn`. A retry is also refused while any effect of the run
has no known owner outcome (``effect_outcome_unknown``).

On a cluster the marker read is a causal read (``services.db_cluster``): whichever node
the operator's connection reaches has applied every commit certified before the read.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.kernel.errors import StateVersionMismatchError
from runtime_svc.kernel.model import AttemptRecord, RunRecord, StepRecord
from runtime_svc.kernel.reconcile import (
    CAUSE_QUARANTINE_FAILED,
    QuarantineEvidence,
    ReconcileDecision,
    ReconcileRefused,
    Resolution,
    decide_reconcile,
)
from runtime_svc.kernel.states import AttemptOutcome, RunState
from runtime_svc.kernel.store_operator import (
    OperatorActor,
    insert_operator_audit_txn,
    unknown_effects_txn,
)
from runtime_svc.kernel.store_rows import lock_latest_attempt, lock_run, lock_step
from runtime_svc.kernel.tables import check_operator_transition, compatibility_status
from runtime_svc.schema import (
    business_events,
    flow_checkpoints,
    flow_runs,
    flow_step_attempts,
    flow_step_executions,
)
from services.db import db_now, fenced_update, run_in_transaction, transaction
from services.errors import (
    FailedPreconditionError,
    FenceLostError,
    InvalidArgumentError,
    NotFoundError,
)
from services.invariants import InvariantError

__all__ = [
    "QuarantineReport",
    "ReconcileResult",
    "inspect_quarantine",
    "reconcile_quarantine",
    "reconcile_quarantine_txn",
]

_AUDIT_ACTION = "reconcile_quarantine"
_MAX_REASON = 200
_MAX_OPERATOR = 128  # audit_records.actor_id


@dataclass(frozen=True)
class QuarantineReport:
    """A quarantined run and what its marker shows."""

    flow_run_id: str
    run_state: RunState
    step_execution_id: str | None
    attempt_id: str | None
    attempt_outcome: AttemptOutcome | None
    evidence: QuarantineEvidence | None

    def as_dict(self) -> dict[str, object]:
        return {
            "flow_run_id": self.flow_run_id,
            "run_state": self.run_state.name,
            "step_execution_id": self.step_execution_id,
            "attempt_id": self.attempt_id,
            "attempt_outcome": None if self.attempt_outcome is None else self.attempt_outcome.name,
            "marker_shows_commit": None if self.evidence is None else self.evidence.shows_commit,
            "evidence": None if self.evidence is None else self.evidence.__dict__,
        }


@dataclass(frozen=True)
class ReconcileResult:
    """What :func:`reconcile_quarantine` applied."""

    report: QuarantineReport
    resolution: Resolution
    run_state: RunState


async def _evidence(
    conn: AsyncConnection, org_id: str, flow_run_id: str, step_id: str, attempt_id: str
) -> QuarantineEvidence:
    a, c, e = flow_step_attempts.c, flow_checkpoints.c, business_events.c

    async def count(stmt: object) -> int:
        return int((await conn.execute(stmt)).scalar_one())  # type: ignore[call-overload]

    return QuarantineEvidence(
        committed_attempts=await count(
            select(func.count())
            .select_from(flow_step_attempts)
            .where(
                a.org_id == org_id,
                a.step_execution_id == step_id,
                a.transaction_outcome == AttemptOutcome.COMMITTED.code,
            )
        ),
        checkpoints_by_attempt=await count(
            select(func.count())
            .select_from(flow_checkpoints)
            .where(
                c.org_id == org_id,
                c.flow_run_id == flow_run_id,
                c.created_by_attempt_id == attempt_id,
            )
        ),
        business_events_by_attempt=await count(
            select(func.count())
            .select_from(business_events)
            .where(e.org_id == org_id, e.attempt_id == attempt_id)
        ),
    )


async def _read(
    conn: AsyncConnection, org_id: str, flow_run_id: str
) -> tuple[RunRecord, StepRecord | None, AttemptRecord | None, QuarantineEvidence | None]:
    root = await lock_run(conn, org_id, flow_run_id)
    if root is None or root.is_deleted:
        raise NotFoundError("flow_run", flow_run_id)
    step = (
        None
        if root.current_step_execution_id is None
        else await lock_step(conn, org_id, root.current_step_execution_id)
    )
    attempt = None if step is None else await lock_latest_attempt(conn, org_id, step)
    evidence = (
        None
        if step is None or attempt is None
        else await _evidence(conn, org_id, flow_run_id, step.step_execution_id, attempt.attempt_id)
    )
    return root, step, attempt, evidence


def _report(
    root: RunRecord,
    step: StepRecord | None,
    attempt: AttemptRecord | None,
    evidence: QuarantineEvidence | None,
) -> QuarantineReport:
    return QuarantineReport(
        root.flow_run_id,
        root.state,
        None if step is None else step.step_execution_id,
        None if attempt is None else attempt.attempt_id,
        None if attempt is None else attempt.outcome,
        evidence,
    )


async def inspect_quarantine(
    engine: AsyncEngine, org_id: str, flow_run_id: str
) -> QuarantineReport:
    """The run's state and its quarantine marker (read-only).

    Raises:
        NotFoundError: no such run in ``org_id`` (or deleted).
    """
    async with transaction(engine, readonly=True) as conn:
        # FOR UPDATE in a read-only transaction is a plain read on SQLite and a
        # short-lived lock elsewhere: the same helpers as the decision path.
        return _report(*await _read(conn, org_id, flow_run_id))


async def _apply(
    conn: AsyncConnection,
    org_id: str,
    root: RunRecord,
    step: StepRecord,
    decision: ReconcileDecision,
) -> None:
    # The operator-only exits of Quarantined (runtime_svc.kernel.tables module docstring).
    check_operator_transition("run", root.state, decision.run_state)
    check_operator_transition("step", step.state, decision.step_state)
    now = await db_now(conn)
    retry = decision.resolution is Resolution.RETRY
    await fenced_update(
        conn,
        flow_runs,
        org_id=org_id,
        key={"flow_run_id": root.flow_run_id},
        expected_version=root.state_version,
        values={
            "runtime_state": decision.run_state.code,
            # A run paused before its step was quarantined stays paused (and projected so).
            "interview_status": compatibility_status(
                decision.run_state, decision.step_state, paused=root.operator_paused_at is not None
            ).code,
            "run_after": now if retry else None,
            "completed_at": None if retry else now,
            "terminal_cause_code": None if retry else CAUSE_QUARANTINE_FAILED,
            "updated_at": now,
        },
        equal={
            "runtime_state": RunState.QUARANTINED.code,
            "current_step_execution_id": step.step_execution_id,
            "ownership_epoch": root.ownership_epoch,
        },
    )
    await fenced_update(
        conn,
        flow_step_executions,
        org_id=org_id,
        key={"step_execution_id": step.step_execution_id},
        expected_version=step.state_version,
        values={
            "state": decision.step_state.code,
            "run_after": now if retry else None,
            "updated_at": now,
        },
        equal={"state": step.state.code, "ownership_epoch": step.ownership_epoch},
    )


def _check_actor(actor: OperatorActor, reason: str) -> None:
    if not actor.actor_id.strip() or len(actor.actor_id) > _MAX_OPERATOR:
        raise InvalidArgumentError(
            f"an operator identity of 1-{_MAX_OPERATOR} characters is required",
            field_path="operator",
        )
    if not reason.strip() or len(reason) > _MAX_REASON:
        raise InvalidArgumentError(
            f"a reason of 1-{_MAX_REASON} characters is required", field_path="reason"
        )


async def reconcile_quarantine_txn(
    conn: AsyncConnection,
    org_id: str,
    flow_run_id: str,
    resolution: Resolution,
    *,
    actor: OperatorActor,
    reason: str,
    max_attempts: int,
    expected_state_version: int | None = None,
    request_rpc: str = "",
) -> ReconcileResult:
    """:func:`reconcile_quarantine` inside the caller's transaction — the one store path
    of both ``python -m runtime_svc.ops quarantine`` and ``RetryQuarantinedRun``.

    ``expected_state_version`` (``None``: no expectation) is compared with the locked
    root and carried by the root's conditional UPDATE.

    Raises:
        NotFoundError: no such run in ``org_id`` (or deleted).
        StateVersionMismatchError: the root is not at ``expected_state_version``.
        FailedPreconditionError: refused; ``reason`` is the code of
            :func:`~runtime_svc.kernel.reconcile.decide_reconcile` or
            ``effect_outcome_unknown`` (an effect of the run has no known owner outcome:
            a retry could repeat it).
        InvalidArgumentError: empty operator or reason, or over-long ones.
    """
    _check_actor(actor, reason)
    root, step, attempt, evidence = await _read(conn, org_id, flow_run_id)
    if expected_state_version is not None and root.state_version != expected_state_version:
        raise StateVersionMismatchError(expected_state_version, root.state_version)
    decision = decide_reconcile(
        root, step, attempt, evidence, resolution, max_attempts=max_attempts
    )
    if isinstance(decision, ReconcileRefused):
        raise FailedPreconditionError(
            f"cannot {resolution.value} run {flow_run_id}: {decision.reason}",
            reason=decision.reason,
        )
    if step is None or attempt is None or evidence is None:
        raise InvariantError("a reconcile decision without its step, attempt or marker")
    if resolution is Resolution.RETRY and await unknown_effects_txn(conn, org_id, flow_run_id):
        raise FailedPreconditionError(
            f"cannot retry run {flow_run_id}: an effect of the run has no known owner "
            "outcome (pending or ambiguous); reconcile it with the effect owner first",
            reason="effect_outcome_unknown",
        )
    try:
        await _apply(conn, org_id, root, step, decision)
    except FenceLostError as exc:
        if expected_state_version is None:
            raise
        raise StateVersionMismatchError(expected_state_version, exc.found_version) from exc
    await insert_operator_audit_txn(
        conn,
        org_id,
        actor,
        _AUDIT_ACTION,
        root,
        {
            "resolution": resolution.value,
            "reason": reason,
            "attempt_outcome": attempt.outcome.name,
            "evidence": evidence.__dict__,
            **({"request_rpc": request_rpc} if request_rpc else {}),
        },
        step_execution_id=step.step_execution_id,
        attempt_id=attempt.attempt_id,
    )
    return ReconcileResult(_report(root, step, attempt, evidence), resolution, decision.run_state)


async def reconcile_quarantine(
    engine: AsyncEngine,
    org_id: str,
    flow_run_id: str,
    resolution: Resolution,
    *,
    operator: str,
    reason: str,
    max_attempts: int,
) -> ReconcileResult:
    """Read the marker under the lifecycle locks and apply the operator's ``resolution``
    (one transaction; :func:`reconcile_quarantine_txn`).

    Args:
        operator: who decided (kept in the audit record; an identity, not a secret).
        reason: a short reason code or ticket reference (at most 200 characters).
        max_attempts: the attempt budget a retry must fit in (the worker policy's).

    Raises:
        NotFoundError: no such run in ``org_id``.
        FailedPreconditionError: the decision was refused (see
            :func:`reconcile_quarantine_txn`).
        InvalidArgumentError: empty operator or an over-long reason.
    """
    actor = OperatorActor(operator)
    _check_actor(actor, reason)
    return await run_in_transaction(
        engine,
        lambda conn: reconcile_quarantine_txn(
            conn,
            org_id,
            flow_run_id,
            resolution,
            actor=actor,
            reason=reason,
            max_attempts=max_attempts,
        ),
    )
