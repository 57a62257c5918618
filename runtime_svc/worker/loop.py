"""The Durable Orchestration worker (§12) and its sweeps (§12.4, §11.1 cleanup).

One step, end to end (:meth:`StepWorker.process`)::

    claim ─► crash_point(after_claim) ─► mark_running ─► crash_point(after_running)
      ─► load plan, step, input checkpoint ─► interpret (PureCompute: no transaction)
      ─► ONE business transaction: current reads → business locks (canonical order)
           → record writes + history/event/audit → commit_step_txn (root/step/attempt
           fence, output checkpoint, root advance) → crash_point(before_step_commit)
      ─► COMMIT ─► crash_point(after_step_commit, step_key) ─► acknowledged

Failures (ARCHITECTURE §2, spec §13.4): a deadlock/lock-wait/late discovery is a proven
rollback → :meth:`FlowRunStateStore.record_rollback` (durable jittered backoff from the
database clock, never an in-process retry loop); a lost COMMIT →
:meth:`FlowRunStateStore.quarantine_commit_unknown` (never retried); a lost fence →
abandon silently (another owner — recovery, cancellation — won). A classified step fault
(bad data, unsupported step kind) is a terminal rollback.

Work discovery keeps ``org_id`` leading: :func:`orgs_with_work` is one bounded query over
the ``(org, runtime_state, …)`` claim index; each org is then served by the kernel's
bounded ``eligible_work``.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.compiler import ExecutionPlan, PlanStep
from runtime_svc.definitions.repository import get_plan_txn
from runtime_svc.kernel import (
    AttemptOutcome,
    Candidate,
    CheckpointInput,
    FailureClass,
    FlowRunStateStore,
    LeaseFence,
    NotEligible,
    RunState,
    StepFailure,
)
from runtime_svc.kernel.decisions import (
    AlreadyCommitted,
    CancelCompleted,
    NextStep,
    NoChange,
    Quarantined,
    RetryExhausted,
    RetryScheduled,
)
from runtime_svc.kernel.store_reads import expired_leases_txn
from runtime_svc.records import Actor, Lineage, RecordView
from runtime_svc.records.model import RecordState
from runtime_svc.records.store import read_record_txn
from runtime_svc.resources import LateResourceDiscoveryError
from runtime_svc.schema import flow_runs, flow_step_executions
from runtime_svc.worker.executor import (
    RUN_OUTPUT_KEY,
    StepFault,
    StepOutcome,
    apply_intents_txn,
    interpret,
    needs_transaction,
)
from runtime_svc.worker.views import RecordViewSource
from services.auth import TrustedRuntimeWorkScope
from services.db import DbErrorClass, classify_db_error, transaction
from services.errors import (
    CommitOutcomeUnknownError,
    ConflictError,
    FenceLostError,
    FlowError,
    NotFoundError,
)
from services.faults import CrashPoint, crash_point, raise_connection_lost_after_commit

__all__ = [
    "DEFAULT_QUEUE_CLASSES",
    "Outcome",
    "PhaseHook",
    "StepWorker",
    "Sweeper",
    "orgs_with_work",
]

log = logging.getLogger(__name__)

#: Queue classes this worker serves (waits and effect completions are later issues).
DEFAULT_QUEUE_CLASSES = ("durable_mutation",)
_MAX_CACHED_PLANS = 256
_ACTIVE_CODES = (
    RunState.RUNNABLE.code,
    RunState.RUNNING.code,
    RunState.CANCEL_REQUESTED.code,
)

#: Test seam: awaited at named phases (``"executed"`` after interpretation, before the
#: business transaction; ``"in_txn"`` inside it, after the business writes and before the
#: lifecycle commit). ``None`` in production.
PhaseHook = Callable[[str, LeaseFence, AsyncConnection | None], Awaitable[None]]


class Outcome(StrEnum):
    """What :meth:`StepWorker.process` did with one candidate."""

    COMMITTED = "committed"
    NOT_ELIGIBLE = "not_eligible"
    FENCE_LOST = "fence_lost"
    RETRY_SCHEDULED = "retry_scheduled"
    FAILED = "failed"
    QUARANTINED = "quarantined"
    ALREADY_COMMITTED = "already_committed"


async def orgs_with_work(engine: AsyncEngine, *, limit: int = 100) -> list[str]:
    """Orgs with runnable, running or cancel-requested runs (bounded, stable order).

    The one cross-org read of the runtime: an index-only ``DISTINCT org_id`` over the
    claim index, limited; every later query is org-scoped.
    """
    t = flow_runs.c
    stmt = (
        select(t.org_id)
        .where(t.runtime_state.in_(_ACTIVE_CODES))
        .group_by(t.org_id)
        .order_by(t.org_id)
        .limit(limit)
    )
    async with transaction(engine, readonly=True) as conn:
        return [str(o) for o in (await conn.execute(stmt)).scalars()]


@dataclass(frozen=True)
class _StepRow:
    plan_step_key: str
    step_kind: str


class StepWorker:
    """Claims and executes due steps (see the module docstring).

    Args:
        engine: the runtime database.
        store: the kernel store (its policy is the lease/retry policy).
        views: record views by work scope.
        owner: this worker's lease owner name.
        queue_classes: queue classes served.
        batch_size: candidates per ``eligible_work`` call.
        hook: test seam (:data:`PhaseHook`).
    """

    def __init__(
        self,
        engine: AsyncEngine,
        store: FlowRunStateStore,
        views: RecordViewSource,
        *,
        owner: str,
        queue_classes: tuple[str, ...] = DEFAULT_QUEUE_CLASSES,
        batch_size: int = 20,
        hook: PhaseHook | None = None,
    ) -> None:
        self._engine = engine
        self.store = store
        self._views = views
        self.owner = owner
        self._queues = queue_classes
        self._batch = batch_size
        self._hook = hook
        self._plans: OrderedDict[tuple[str, str], tuple[TrustedRuntimeWorkScope, ExecutionPlan]]
        self._plans = OrderedDict()

    # --- scheduling ----------------------------------------------------------------------

    async def run_batch(self, org_id: str) -> list[Outcome]:
        """One bounded batch of due candidates of ``org_id``, each processed in turn."""
        done: list[Outcome] = []
        for queue in self._queues:
            for candidate in await self.store.eligible_work(org_id, queue, limit=self._batch):
                done.append(await self.process(org_id, candidate))
        return done

    async def run_once(self, *, org_limit: int = 100) -> list[Outcome]:
        """One pass over the orgs that have work."""
        done: list[Outcome] = []
        for org_id in await orgs_with_work(self._engine, limit=org_limit):
            done.extend(await self.run_batch(org_id))
        return done

    # --- one step --------------------------------------------------------------------------

    async def process(self, org_id: str, candidate: Candidate) -> Outcome:
        """Claim ``candidate`` and, if won, execute and commit its step."""
        claimed = await self.store.claim(org_id, candidate, lease_owner=self.owner)
        if isinstance(claimed, NotEligible):
            return Outcome.NOT_ELIGIBLE
        crash_point(CrashPoint.AFTER_CLAIM_COMMIT)
        try:
            fence = await self.store.mark_running(org_id, claimed)
            crash_point(CrashPoint.AFTER_RUNNING_COMMIT)
            return await self._execute(org_id, fence)
        except FenceLostError:
            # Another owner (recovery, cancellation) won: its transition is authoritative.
            log.info("fence lost on %s; abandoning", claimed.step_execution_id)
            return Outcome.FENCE_LOST

    async def _execute(self, org_id: str, fence: LeaseFence) -> Outcome:
        try:
            run = await self.store.get_run(org_id, fence.flow_run_id)
            step_row = await self._step_row(org_id, fence.step_execution_id)
            scope, plan = await self._plan(org_id, run.plan_id)
            step = plan.step(step_row.plan_step_key)
        except (NotFoundError, KeyError):
            # Deleted meanwhile (the fence will fail too) or a plan that lost its step.
            return await self._fail(org_id, fence, "plan_step_missing")
        if fence.input_checkpoint_id is None:
            return await self._fail(org_id, fence, "input_checkpoint_missing")
        checkpoint = await self.store.get_checkpoint(
            org_id, fence.flow_run_id, fence.input_checkpoint_id
        )
        context: dict[str, Any] = json.loads(checkpoint.context_json) or {}
        in_txn = needs_transaction(step)
        outcome: StepOutcome | None = None
        view: RecordView | None = None
        try:
            if in_txn:
                try:
                    view = await self._views.view_for(scope)
                except FlowError:
                    log.warning("no record view for %s; retrying later", org_id, exc_info=True)
                    return await self._retry(org_id, fence, "metadata_view_unavailable")
            else:
                # Pure compute: no transaction, no connection held (§12.2 step 4).
                outcome = await interpret(plan, step, context)
                fence = await self._heartbeat_if_due(org_id, fence)
        except StepFault as fault:
            return await self._fail(org_id, fence, fault.code)
        if self._hook is not None:
            await self._hook("executed", fence, None)
        return await self._commit(org_id, fence, plan, step, context, outcome, view)

    async def _commit(
        self,
        org_id: str,
        fence: LeaseFence,
        plan: ExecutionPlan,
        step: PlanStep,
        context: dict[str, Any],
        outcome: StepOutcome | None,
        view: RecordView | None,
    ) -> Outcome:
        key = step.key
        try:
            async with transaction(self._engine) as conn:
                if outcome is None:
                    outcome = await interpret(plan, step, context, reader=_reader(conn, org_id))
                if outcome.intents:
                    assert view is not None
                    await apply_intents_txn(
                        conn,
                        org_id,
                        view,
                        outcome.intents,
                        actor=Actor("flow_run", fence.flow_run_id),
                        lineage=Lineage(
                            fence.flow_run_id, fence.step_execution_id, fence.attempt_id
                        ),
                    )
                if self._hook is not None:
                    await self._hook("in_txn", fence, conn)
                await self.store.commit_step_txn(
                    conn, org_id, fence, output=_output(outcome), advance=outcome.advance
                )
                crash_point(CrashPoint.BEFORE_STEP_COMMIT, key)
            raise_connection_lost_after_commit(CrashPoint.AFTER_STEP_COMMIT, key)
        except StepFault as fault:  # rolled back before any lifecycle write
            return await self._fail(org_id, fence, fault.code)
        except FenceLostError:
            log.info("final fence lost on %s; business writes rolled back", key)
            return Outcome.FENCE_LOST
        except CommitOutcomeUnknownError:
            return await self._quarantine(org_id, fence, AttemptOutcome.COMMIT_UNKNOWN)
        except LateResourceDiscoveryError:
            return await self._retry(org_id, fence, "late_resource_discovery")
        except Exception as exc:
            kind = classify_db_error(exc)
            if kind is DbErrorClass.RETRYABLE_CONFLICT:
                return await self._retry(org_id, fence, "deadlock")
            if kind is DbErrorClass.LOCK_WAIT_TIMEOUT:
                return await self._retry(org_id, fence, "lock_wait_timeout")
            if kind is DbErrorClass.OUTCOME_UNKNOWN:
                return await self._quarantine(org_id, fence, AttemptOutcome.ROLLBACK_UNKNOWN)
            if isinstance(exc, ConflictError):  # stale version between read and lock
                return await self._retry(org_id, fence, "write_conflict")
            if isinstance(exc, FlowError):
                return await self._fail(org_id, fence, exc.reason or "step_error")
            log.exception("step %s failed unexpectedly; rolled back, retrying later", key)
            return await self._retry(org_id, fence, "internal_error")
        crash_point(CrashPoint.AFTER_STEP_COMMIT, key)
        return Outcome.COMMITTED

    # --- outcomes ------------------------------------------------------------------------

    async def _retry(self, org_id: str, fence: LeaseFence, code: str) -> Outcome:
        return await self._rollback(
            org_id, fence, StepFailure(FailureClass.RETRYABLE, code), Outcome.RETRY_SCHEDULED
        )

    async def _fail(self, org_id: str, fence: LeaseFence, code: str) -> Outcome:
        return await self._rollback(
            org_id, fence, StepFailure(FailureClass.TERMINAL, code), Outcome.FAILED
        )

    async def _rollback(
        self, org_id: str, fence: LeaseFence, failure: StepFailure, ok: Outcome
    ) -> Outcome:
        try:
            decision = await self.store.record_rollback(org_id, fence, failure)
        except FenceLostError:
            return Outcome.FENCE_LOST
        if isinstance(decision, RetryScheduled):
            return ok
        if isinstance(decision, RetryExhausted):
            return Outcome.FAILED
        return Outcome.FENCE_LOST  # cancellation won

    async def _quarantine(self, org_id: str, fence: LeaseFence, outcome: AttemptOutcome) -> Outcome:
        try:
            decision = await self.store.quarantine_commit_unknown(org_id, fence, outcome)
        except FenceLostError:
            return Outcome.FENCE_LOST
        if isinstance(decision, AlreadyCommitted):
            return Outcome.ALREADY_COMMITTED
        if isinstance(decision, Quarantined):
            return Outcome.QUARANTINED
        return Outcome.FENCE_LOST  # cancellation won

    # --- helpers -------------------------------------------------------------------------

    async def _heartbeat_if_due(self, org_id: str, fence: LeaseFence) -> LeaseFence:
        """Extend the lease when less than half of it is left (long pure compute)."""
        async with transaction(self._engine, readonly=True) as conn:
            now = await self.store._clock(conn)  # the store's (shiftable) durable clock
        remaining = (fence.lease_until - now).total_seconds() * 1000
        if remaining < self.store.policy.lease_duration_ms / 2:
            return await self.store.extend_lease(org_id, fence)
        return fence

    async def _step_row(self, org_id: str, step_execution_id: str) -> _StepRow:
        s = flow_step_executions.c
        stmt = select(s.plan_step_key, s.step_kind).where(
            s.org_id == org_id, s.step_execution_id == step_execution_id
        )
        async with transaction(self._engine, readonly=True) as conn:
            row = (await conn.execute(stmt)).first()
        if row is None:
            raise NotFoundError("flow_step_execution", step_execution_id)
        return _StepRow(str(row[0]), str(row[1]))

    async def _plan(
        self, org_id: str, plan_id: str
    ) -> tuple[TrustedRuntimeWorkScope, ExecutionPlan]:
        key = (org_id, plan_id)
        cached = self._plans.get(key)
        if cached is not None:
            self._plans.move_to_end(key)
            return cached
        async with transaction(self._engine, readonly=True) as conn:
            row = await get_plan_txn(conn, org_id, plan_id)
        if row is None:
            raise NotFoundError("execution_plan", plan_id)
        value = (row.scope, row.plan())
        self._plans[key] = value
        while len(self._plans) > _MAX_CACHED_PLANS:
            self._plans.popitem(last=False)
        return value


def _reader(
    conn: AsyncConnection, org_id: str
) -> Callable[[str, str], Awaitable[RecordState | None]]:
    async def read(object_name: str, record_id: str) -> RecordState | None:
        return await read_record_txn(conn, org_id, object_name, record_id)

    return read


def _output(outcome: StepOutcome) -> CheckpointInput:
    context = dict(outcome.context)
    advance = outcome.advance
    cursor = {"next_step": advance.plan_step_key} if isinstance(advance, NextStep) else {}
    if not isinstance(advance, NextStep):
        # The run's output is the final context, recorded once with the terminal commit.
        context[RUN_OUTPUT_KEY] = {
            k: v for k, v in outcome.context.items() if not k.startswith("$")
        }
    return CheckpointInput(context=context, plan_cursor=cursor)


class Sweeper:
    """Lease recovery (§12.4) and cancellation cleanup (§11.1), bounded per org."""

    def __init__(self, engine: AsyncEngine, store: FlowRunStateStore, *, limit: int = 100) -> None:
        self._engine = engine
        self.store = store
        self._limit = limit

    async def sweep_org(self, org_id: str) -> tuple[int, int]:
        """Recover expired leases, then complete pending cancellations of ``org_id``;
        returns ``(recovered, cancelled)``."""
        async with transaction(self._engine, readonly=True) as conn:
            now = await self.store._clock(conn)  # the store's (shiftable) durable clock
            expired = await expired_leases_txn(conn, org_id, now, self._limit)
        recovered = 0
        for lease in expired:
            # Between the non-locking scan and the fenced recovery transaction.
            crash_point(CrashPoint.DURING_RECOVERY)
            decision = await self.store.recover_step(
                org_id, lease.flow_run_id, lease.step_execution_id
            )
            if not isinstance(decision, NoChange):
                recovered += 1
        cancelled = 0
        for run_id in await self.store.pending_cancellations(org_id, limit=self._limit):
            if isinstance(await self.store.complete_cancel(org_id, run_id), CancelCompleted):
                cancelled += 1
        return recovered, cancelled

    async def sweep_once(self, *, org_limit: int = 100) -> tuple[int, int]:
        """One pass over the orgs with active runs."""
        total = (0, 0)
        for org_id in await orgs_with_work(self._engine, limit=org_limit):
            r, c = await self.sweep_org(org_id)
            total = (total[0] + r, total[1] + c)
        return total
