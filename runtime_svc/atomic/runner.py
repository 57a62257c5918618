"""Bounded Atomic execution (§9.2, §18.3): the whole Flow is one logical mutation step.

The compiler proved the plan's single ``BoundedMutation`` step (``$atomic``) needs one
short owned transaction with a known, bounded read/write/lock set. A run is executed as:

1. **Root first.** ``StartRun`` (or after-save admission) persists the root, its first
   step and the immutable input checkpoint, bound to the plan, *before* any mutation
   (:meth:`~runtime_svc.kernel.FlowRunStateStore.create_run`).
2. **Claim.** :class:`AtomicRunner` claims the run's step through the same fenced §12.1
   claim the workers use (lifecycle-only transactions that start at the root). A run
   created by this runner's caller for it (:meth:`AtomicRunner.start`,
   ``RunService.start_run``) is created already claimed and Running in the creating
   transaction (:meth:`~runtime_svc.kernel.FlowRunStateStore.create_run_claimed_txn`,
   ``docs/adr/0005-bounded-atomic-created-claimed.md``): the step's fence and input
   come back in memory, so no candidate read, claim transaction or preparation read
   follows — the business transaction is the run's second and last.
3. **One transaction.** The step worker's business transaction
   (:meth:`runtime_svc.worker.StepWorker.process`): current reads, the declared business /
   parent / history locks in canonical order, every record write with its history, event
   and audit rows, then — entering Flow state at the root — the final checkpoint and the
   terminal state, committed together. The step's compiled bounds are enforced while it
   runs (:func:`runtime_svc.worker.executor.meter_for`); its actual resources are checked
   against the declared ones before the first lock.
4. **Outcomes.** A deadlock victim or lock-wait timeout is a proven rollback: the kernel
   schedules a durable, jittered retry of the *whole step* from the same input checkpoint
   (§13.4 — never a tight in-process loop), and this runner claims it again when it is
   due, within the caller's budget. A lost COMMIT response quarantines the step
   (``CommitUnknown``; never retried). A budget or resource-bound overrun ends the run
   terminally with the bound named in its cause code.

``StartRun`` waits at most its API budget: it returns the terminal run when the step
committed (or failed) in time, and the accepted run identity otherwise — the background
workers (which also serve the ``bounded_atomic_foreground`` lane) finish it.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque

from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.compiler.kinds import QueueClass
from runtime_svc.kernel import (
    ClaimedStart,
    FlowRunStateStore,
    RunRecord,
    StartRunRequest,
    StartRunResult,
)
from runtime_svc.kernel.states import TERMINAL_RUN_STATES
from runtime_svc.records.engine import ChangeSink
from runtime_svc.worker.loop import Outcome, PhaseHook, StepWorker
from runtime_svc.worker.views import RecordViewSource
from services.auth import TrustedRuntimeWorkScope
from services.faults import CrashPoint, crash_point

__all__ = ["ATOMIC_QUEUE", "AtomicRunner"]

#: The queue class of a Bounded Atomic step (§16.1 lane).
ATOMIC_QUEUE: str = QueueClass.BOUNDED_ATOMIC_FOREGROUND.value
#: Outcomes after which the run is terminal (the single step committed its terminal
#: advance, failed terminally, or was quarantined).
_SETTLED = frozenset({Outcome.COMMITTED, Outcome.FAILED, Outcome.QUARANTINED})
#: Pause between looks at a run whose retry is not due yet (or that another owner holds).
_POLL_S = 0.02


class AtomicRunner:
    """Executes Bounded Atomic runs synchronously for their caller.

    Args:
        engine: the runtime database.
        store: the kernel store (its policy is the lease/retry policy).
        views: record views by work scope.
        owner: lease-owner name of this process's synchronous executor.
        hook: test seam passed to the step worker.
        max_recent: how many of the latest attempt outcomes :attr:`outcomes` keeps (a
            long-lived process runs millions of attempts; the counts are kept in full).
        changes: the record-change wake-signal producer of the run's record writes.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        store: FlowRunStateStore,
        views: RecordViewSource,
        *,
        owner: str = "atomic",
        hook: PhaseHook | None = None,
        max_recent: int = 1000,
        changes: ChangeSink | None = None,
    ) -> None:
        self.store = store
        self._worker = StepWorker(
            engine,
            store,
            views,
            owner=owner,
            queue_classes=(ATOMIC_QUEUE,),
            hook=hook,
            changes=changes,
        )
        self._recent: deque[Outcome] = deque(maxlen=max_recent)
        #: How many attempts ended with each outcome (metrics evidence).
        self.counts: Counter[Outcome] = Counter()

    @property
    def outcomes(self) -> list[Outcome]:
        """The latest ``max_recent`` attempt outcomes, oldest first (test evidence)."""
        return list(self._recent)

    def _record(self, outcome: Outcome) -> None:
        self._recent.append(outcome)
        self.counts[outcome] += 1

    @property
    def owner(self) -> str:
        """The lease owner this runner claims (and a creating transaction claims for it)."""
        return self._worker.owner

    async def start(
        self, scope: TrustedRuntimeWorkScope, request: StartRunRequest, budget_s: float
    ) -> tuple[StartRunResult, RunRecord]:
        """Create the run already claimed for this runner (one transaction,
        :meth:`~runtime_svc.kernel.FlowRunStateStore.create_run_claimed`) and drive it
        (:meth:`run_claimed`); an idempotent replay is driven by :meth:`run`. Returns
        the creation result and the run's state after the drive."""
        created = await self.store.create_run_claimed(scope, request, lease_owner=self.owner)
        if created.claimed is None:
            run = await self.run(scope.org_id, created.run.flow_run_id, budget_s)
        else:
            run = await self.run_claimed(created.run, created.claimed, budget_s)
        return created, run

    async def run_claimed(self, run: RunRecord, start: ClaimedStart, budget_s: float) -> RunRecord:
        """Drive ``run``, whose first step its creating transaction claimed for this
        runner (``start``): execute and commit that step at once, then — when it did not
        settle the run (a retry was scheduled) — go on like :meth:`run` within the rest
        of ``budget_s``."""
        deadline = time.monotonic() + max(budget_s, 0.0)
        # The window between the create+claim COMMIT and the business transaction: the
        # step is Running under this runner's lease; if the process dies here, only lease
        # expiry hands it on (ADR 0005).
        crash_point(CrashPoint.AFTER_CREATE_CLAIMED)
        outcome = await self._worker.process_claimed(run.org_id, run, start)
        self._record(outcome)
        if outcome in _SETTLED or time.monotonic() >= deadline:
            return await self._settled(run.org_id, run.flow_run_id, outcome)
        return await self.run(run.org_id, run.flow_run_id, deadline - time.monotonic())

    async def run(self, org_id: str, flow_run_id: str, budget_s: float) -> RunRecord:
        """Drive the run until it is terminal or ``budget_s`` is spent; returns its
        current state either way (bounded: one attempt or one short pause per turn)."""
        deadline = time.monotonic() + max(budget_s, 0.0)
        while True:
            candidate = await self.store.candidate_for_run(org_id, flow_run_id)
            if candidate is not None and candidate.queue_class == ATOMIC_QUEUE:
                outcome = await self._worker.process(org_id, candidate)
                self._record(outcome)
                if outcome in _SETTLED or time.monotonic() >= deadline:
                    return await self._settled(org_id, flow_run_id, outcome)
                continue
            run = await self._state(org_id, flow_run_id)
            if run.state in TERMINAL_RUN_STATES or time.monotonic() >= deadline:
                return run
            # A retry not yet due, or another owner (a worker) holds the step.
            await asyncio.sleep(min(_POLL_S, max(deadline - time.monotonic(), 0.0)))

    async def _settled(self, org_id: str, flow_run_id: str, outcome: Outcome) -> RunRecord:
        # A commit that ended the run answers with the root it wrote (derived in memory,
        # pinned equal to the stored row by test_kernel_derived_rows): no read-back
        # transaction.
        root = self._worker.last_committed_root
        if (
            outcome is Outcome.COMMITTED
            and root is not None
            and root.flow_run_id == flow_run_id
            and root.state in TERMINAL_RUN_STATES
        ):
            return root
        return await self._state(org_id, flow_run_id)

    async def _state(self, org_id: str, flow_run_id: str) -> RunRecord:
        return await self.store.get_run(org_id, flow_run_id, include_deleted=True)
