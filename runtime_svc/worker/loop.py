"""The Durable Orchestration worker (§12) and its sweeps (§12.4, §11.1 cleanup).

One step, end to end (:meth:`StepWorker.process`)::

    claim + Running in one transaction (ADR 0003)
      ─► crash_point(after_claim) ─► crash_point(after_running)
      ─► [heartbeat task: extend_lease every lease/3 (§12.3)]
           load plan, step, input checkpoint (+ ReadVerificationSet)
           ─► interpret (PureCompute: no transaction)
         [heartbeat stopped; a heartbeat that lost the fence abandons the step here]
      ─► ONE business transaction: current reads → crash_point(after_step_begin)
           → business locks (canonical order)
           → snapshot-token verification under lock (§12.2 step 6, see ``snapshots``)
           → record writes + history/event/audit → crash_point(before_step_fence)
           → commit_step_txn (root/step/attempt fence, output checkpoint +
           ReadVerificationSet, root advance) → crash_point(before_step_commit)
      ─► COMMIT ─► crash_point(after_step_commit, step_key) ─► acknowledged

(On MariaDB/MySQL the commit's writes and the COMMIT are one round trip, each fenced
UPDATE's row count guarded on the server before the COMMIT — ADR 0014; the
``before_step_commit`` point then fires after the fence's lock read and decision, right
before that round trip.)

The heartbeat covers only the phases outside the business transaction: the mutation
transaction never depends on it (§12.3), and the step budget is admitted below the lease.

Failures (ARCHITECTURE §2, spec §13.4): a deadlock/lock-wait/late discovery is a proven
rollback → :meth:`FlowRunStateStore.record_rollback` (durable jittered backoff from the
database clock, never an in-process retry loop); a lost COMMIT →
:meth:`FlowRunStateStore.quarantine_commit_unknown` (never retried); a lost fence →
abandon silently (another owner — recovery, cancellation — won). A classified step fault
(bad data, unsupported step kind) is a terminal rollback; so is a step whose actual
resource set — or its expansion by a late discovery — leaves the plan step's declared
classes or bounds (``resource_bound_exceeded``, §13.3: checked before any business lock,
never retried).

Work discovery keeps ``org_id`` leading: :func:`orgs_with_work` is one bounded keyset query
over the ``(org, runtime_state, …)`` claim index, walked by an
:class:`~services.background.OrgRotation` that resumes after the last org it served and
wraps around, so every org with work is served however many orgs sort before it; each org
is then served by the kernel's bounded ``eligible_work``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from sqlalchemy import Integer, bindparam, false, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.admission.controller import AdmissionController
from runtime_svc.admission.events import Ticket, admitted
from runtime_svc.compiler import ExecutionPlan, PlanStep, StepKind
from runtime_svc.definitions.repository import get_plan_txn
from runtime_svc.kernel import (
    AttemptOutcome,
    Candidate,
    CheckpointInput,
    ClaimedStart,
    CommitResult,
    CommitTail,
    ContinueAs,
    FailureClass,
    FlowRunStateStore,
    LeaseFence,
    NotEligible,
    RunRecord,
    RunState,
    StepFailure,
)
from runtime_svc.kernel.decisions import (
    AlreadyCommitted,
    CancelCompleted,
    FailRun,
    FinishRun,
    HandOff,
    NextStep,
    NoChange,
    Quarantined,
    RetryExhausted,
    RetryScheduled,
)
from runtime_svc.observability.hooks import StepWatch, attempt_exhausted, attempt_retried
from runtime_svc.records import Actor, Lineage, RecordView
from runtime_svc.records.model import RecordState
from runtime_svc.records.store import read_record_txn
from runtime_svc.resources import LateResourceDiscoveryError, LockPlan
from runtime_svc.schema import flow_checkpoints, flow_runs, flow_step_executions
from runtime_svc.worker.binary import BinaryCheck
from runtime_svc.worker.executor import (
    RUN_OUTPUT_KEY,
    RecordQuery,
    StepFault,
    StepOutcome,
    apply_intents_txn,
    interpret,
    meter_for,
    needs_transaction,
    record_query,
)
from runtime_svc.worker.snapshots import (
    ReadToken,
    merge_tokens,
    parse_set,
    refresh_tokens,
    tokens_for,
    verify_tokens_txn,
)
from runtime_svc.worker.views import RecordViewSource
from services.auth import TrustedRuntimeWorkScope
from services.background import OrgRotation
from services.db import DbErrorClass, classify_db_error, transaction
from services.db_batch import Read, Write, execute_reads
from services.errors import (
    CommitOutcomeUnknownError,
    ConflictError,
    FenceLostError,
    FlowError,
    NotFoundError,
)
from services.evolve import evolve
from services.faults import (
    CrashPoint,
    crash_point,
    raise_connection_lost_after_commit,
    step_entered,
)
from services.invariants import InvariantError
from services.metrics import metrics

if TYPE_CHECKING:  # the waits and effects packages import the executor of this one
    from runtime_svc.effects.steps import EffectSteps, PreparedSubmit
    from runtime_svc.identity.reauth import Reauthorizer
    from runtime_svc.records.engine import ChangeSink
    from runtime_svc.waits.preclaim import PreClaimedWake
    from runtime_svc.waits.steps import PreparedWait, WaitSteps

__all__ = [
    "DEFAULT_CONTINUATION_LIMIT",
    "DEFAULT_QUEUE_CLASSES",
    "Outcome",
    "PhaseHook",
    "StepWorker",
    "Sweeper",
    "orgs_with_work",
]

log = logging.getLogger(__name__)

#: Attempts of the quarantine transaction after a lost COMMIT (see ``_quarantine``).
_QUARANTINE_ATTEMPTS = 3

#: Queue classes this worker serves (§16.1): mutation steps, synchronous-profile leftovers,
#: woken waits and effect completions. A step the executor cannot run (e.g. an effect
#: completion before the effect owner lands) is claimed and fails closed
#: (``unsupported_step_kind``) rather than sitting on a lane nobody claims, which would
#: leave its run ``Runnable`` for ever (issue 10, item 4).
DEFAULT_QUEUE_CLASSES = (
    "durable_mutation",
    "bounded_atomic_foreground",
    "dependency_wakeup",
    "effect_completion",
)
_MAX_CACHED_PLANS = 256
#: Default bound of consecutive continued steps (see ``StepWorker``).
DEFAULT_CONTINUATION_LIMIT = 32
_EFFECT_KINDS = frozenset({StepKind.EFFECT_SUBMIT, StepKind.EFFECT_COMPLETION})
_ACTIVE_CODES = (
    RunState.RUNNABLE.code,
    RunState.RUNNING.code,
    RunState.CANCEL_REQUESTED.code,
)

#: Test seam: awaited at named phases (``"compute"`` during pure compute, before the
#: step's nodes are interpreted, while the heartbeat runs; ``"heartbeat"`` after each
#: successful periodic lease extension, with the extended fence; ``"executed"`` after
#: interpretation, before the business transaction; ``"in_txn"`` inside it, after the
#: business locks and writes — a lone mutation's writes prepared, to be sent with the
#: commit's, ADR 0011 — and before the lifecycle commit). ``None`` in production.
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


#: :func:`orgs_with_work`'s read, built once per shape (from the start / after an org).
_ORGS = (
    select(flow_runs.c.org_id)
    .where(flow_runs.c.runtime_state.in_(_ACTIVE_CODES))
    .group_by(flow_runs.c.org_id)
    .order_by(flow_runs.c.org_id)
    .limit(bindparam("limit", type_=Integer))
)
_ORGS_AFTER = _ORGS.where(flow_runs.c.org_id > bindparam("after"))


async def orgs_with_work(
    engine: AsyncEngine, *, after: str | None = None, limit: int = 100
) -> list[str]:
    """Orgs with runnable, running or cancel-requested runs, in org order after ``after``
    (bounded; an :class:`~services.background.OrgRotation` walks them all).

    The one cross-org read of the runtime: an index-only ``DISTINCT org_id`` over the
    claim index, limited; every later query is org-scoped.
    """
    stmt = _ORGS_AFTER if after is not None else _ORGS
    params = {"after": after, "limit": limit} if after is not None else {"limit": limit}
    async with transaction(engine, readonly=True) as conn:
        return [str(o) for o in (await conn.execute(stmt, params)).scalars()]


@dataclass(frozen=True)
class _StepRow:
    plan_step_key: str
    step_kind: str
    invocation_ordinal: int


class StepWorker:
    """Claims and executes due steps (see the module docstring).

    Args:
        engine: the runtime database.
        store: the kernel store (its policy is the lease/retry policy).
        views: record views by work scope.
        owner: this worker's lease owner name.
        queue_classes: queue classes served.
        batch_size: candidates per ``eligible_work`` call.
        org_batch: orgs one :meth:`run_once` serves (the rotation resumes after them).
        hook: test seam (:data:`PhaseHook`).
        heartbeat: run the periodic lease heartbeat (§12.3); ``False`` is a test seam.
        heartbeat_interval_s: heartbeat period; default one third of the policy lease.
        binary_check: verifies each plan with the catalog before its first claim
            (:mod:`runtime_svc.worker.binary`); ``None`` skips it (tests, view-file
            dev stacks without a catalog).
        waits: executes ``DependencyWait`` steps (``None``: they fail closed with
            ``unsupported_step_kind``).
        changes: the record-change wake-signal producer of the step's record writes.
        effects: executes ``EffectSubmit``/``EffectCompletion`` steps (``None``: they
            fail closed with ``unsupported_step_kind``).
        identity: reauthorizes each durable step before its transaction (§17.2,
            :mod:`runtime_svc.identity`); ``None`` skips it (tests of other concerns).
        admission: the §16 admission controller (lanes, budgets, pressure, fairness,
            per-key limits); ``None`` claims every due candidate (tests).
        continuation_limit: consecutive steps of one run a batch may run by step
            continuation after the claimed one (``docs/adr/0002-step-continuation.md``);
            ``0`` turns continuation off. Bounded so that one long run does not keep
            the worker from the rest of its batch.
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
        org_batch: int = 100,
        hook: PhaseHook | None = None,
        heartbeat: bool = True,
        heartbeat_interval_s: float | None = None,
        binary_check: BinaryCheck | None = None,
        waits: WaitSteps | None = None,
        changes: ChangeSink | None = None,
        effects: EffectSteps | None = None,
        identity: Reauthorizer | None = None,
        admission: AdmissionController | None = None,
        continuation_limit: int = DEFAULT_CONTINUATION_LIMIT,
    ) -> None:
        if continuation_limit < 0:
            raise ValueError("continuation_limit must be >= 0")
        self._continuation_limit = continuation_limit
        self._engine = engine
        self._identity = identity
        self.admission = admission
        self._waits = waits
        self._effects = effects
        self._changes = changes
        self.store = store
        self._views = views
        self.owner = owner
        self._queues = queue_classes
        self._batch = batch_size
        self._hook = hook
        self._heartbeat = heartbeat
        self._beat_s = (
            heartbeat_interval_s
            if heartbeat_interval_s is not None
            else store.policy.lease_duration_ms / 3000
        )
        self._plans: OrderedDict[
            tuple[str, str], tuple[TrustedRuntimeWorkScope, ExecutionPlan, int]
        ]
        self._plans = OrderedDict()
        #: The root as the latest successful final commit of this worker left it (derived
        #: in memory, ``kernel.applied``; ``None`` when it continued the run or failed):
        #: a synchronous caller answers from it instead of reading the run back.
        self.last_committed_root: RunRecord | None = None
        self._orgs = _rotation(engine, org_batch)
        self._binary = binary_check
        self._rng = random.Random()  # noqa: S311 - claim order spread, not a secret

    # --- scheduling ----------------------------------------------------------------------

    async def run_batch(self, org_id: str) -> list[Outcome]:
        """One bounded batch of due candidates of ``org_id``, each processed in turn.

        With an admission controller (§16) the lanes and their limits come from it
        before any query, and each candidate is admitted (or deferred, untouched) before
        its claim — i.e. before a business connection is acquired.
        """
        admission = self.admission
        if admission is None:
            lanes = [(queue, self._batch) for queue in self._queues]
        else:
            lanes = await admission.lanes(org_id, self._queues, self._batch)
        done: list[Outcome] = []
        found = 0
        more = False
        # With admission, one candidate more than the lane may take is fetched (never
        # processed): it tells a backlogged org from a sparse one (served first, §16).
        peek = 0 if admission is None else 1
        for queue, limit in lanes:
            batch = await self.store.eligible_work(org_id, queue, limit=limit + peek)
            more = more or len(batch) > limit
            batch = batch[:limit]
            found += len(batch)
            # The query's order is stable, so every replica fetches the same head; walking
            # the batch in a random order spreads them over it instead of all racing for
            # its first candidate (on a cluster each lost race is a failed COMMIT).
            self._rng.shuffle(batch)
            for candidate in batch:
                if admission is None:
                    done.extend(await self.process_chain(org_id, candidate))
                else:
                    done.extend(await self._admitted(admission, org_id, candidate))
        if admission is not None:
            admission.finished_org(org_id, found, more=more)
        return done

    async def process_found(self, org_id: str, candidate: Candidate) -> list[Outcome]:
        """A candidate found outside :meth:`run_batch`'s query (a wake hint naming a run a
        resolution made runnable): admitted like any candidate when admission is
        configured (§16), then processed with its continuation chain."""
        if self.admission is None:
            return await self.process_chain(org_id, candidate)
        return await self._admitted(self.admission, org_id, candidate)

    async def _admitted(
        self, admission: AdmissionController, org_id: str, candidate: Candidate
    ) -> list[Outcome]:
        """Process ``candidate`` (and its continuation chain) if admission admits it.

        The ticket covers the whole chain: a continued step belongs to the same run and
        keeps the admitted slot until the chain ends; every outcome of the chain is
        reported to the admission window, the last one with the ticket's release.
        """
        plan: ExecutionPlan | None = None
        if candidate.plan_id:
            try:
                _, plan, _ = await self._plan(org_id, candidate.plan_id)
            except (NotFoundError, KeyError, ValueError):
                plan = None  # process() refuses it; admission then knows only the lane
        ticket = await admission.admit(org_id, candidate, plan)
        if ticket is None:
            return [Outcome.NOT_ELIGIBLE]
        outcomes = [Outcome.NOT_ELIGIBLE]
        try:
            with admitted(ticket):
                held = ticket
                outcomes = await self.process_chain(
                    org_id, candidate, gate=lambda lane: admission.may_continue(held, lane)
                )
        finally:
            for earlier in outcomes[:-1]:
                admission.observe(earlier.value)
            admission.release(ticket, outcomes[-1].value)
        return outcomes

    async def run_once(self) -> list[Outcome]:
        """One bounded pass: the next batch of orgs that have work (in rotation; with
        admission, the orgs whose last visit drained them first)."""
        done: list[Outcome] = []
        orgs = await self._orgs.next_batch()
        if self.admission is not None:
            orgs = self.admission.order(orgs)  # sparse orgs first (§16, DRR++)
        for org_id in orgs:
            done.extend(await self.run_batch(org_id))
        return done

    # --- one step --------------------------------------------------------------------------

    async def process(self, org_id: str, candidate: Candidate) -> Outcome:
        """Claim ``candidate`` and, if won, execute and commit its step (the attempt
        carries the run's trace id; its span is current while the step runs). One step
        only: no continuation (see :meth:`process_chain`).

        With a binary check, a plan this binary may not execute (its sealed catalog
        entries or handlers do not match, §8.4) is never claimed: nothing is mutated.
        """
        return (await self._process(org_id, candidate, _Chain(0, None)))[0]

    async def process_chain(
        self, org_id: str, candidate: Candidate, *, gate: Callable[[str], bool] | None = None
    ) -> list[Outcome]:
        """:meth:`process`, then the run's next steps by step continuation while each
        commit continues the run (at most ``continuation_limit`` more); one outcome per
        step, in order. ``gate(lane)`` (admission, §16) is asked, inside the committing
        transaction and before the next step is claimed, whether the chain may go on
        into a step of ``lane``; ``False`` leaves that step to ordinary discovery."""
        chain = _Chain(self._continuation_limit, None, gate=gate)
        return await self._process(org_id, candidate, chain)

    async def process_claimed(self, org_id: str, run: RunRecord, start: ClaimedStart) -> Outcome:
        """Execute and commit the first step of ``run``, which its creating transaction
        already claimed and made Running for this worker (``start``, ADR 0005): no
        candidate read, no claim transaction, and no preparation read — the step's
        input is what that transaction wrote. One step only; every later move (retry,
        failure, commit) is the ordinary fenced path of :meth:`process`."""
        fence, first = start.fence, start.first_step
        known = _Known(
            plan_id=run.plan_id,
            step=_StepRow(first.plan_step_key, first.step_kind, first.invocation_ordinal),
            payload=start.context_json,
            verification=(
                None
                if start.read_verification_json is None
                else json.loads(start.read_verification_json)
            ),
            sequence=start.sequence,
        )
        watch = StepWatch(
            lane=first.queue_class,
            profile=run.execution_profile,
            step_kind=first.step_kind,
            trace_context=run.trace_context,
            run_after=None,
        )
        with watch.attempt(
            fence.flow_run_id, fence.step_execution_id, fence.attempt_id, fence.attempt_number
        ) as finish:
            outcome = await self._running(org_id, fence, _Chain(0, watch.trace_id), known)
            finish(outcome.value)
        return outcome

    async def _process(self, org_id: str, candidate: Candidate, chain: _Chain) -> list[Outcome]:
        if self._binary is not None and candidate.plan_id:
            try:
                scope, plan, _ = await self._plan(org_id, candidate.plan_id)
            except NotFoundError:
                return [Outcome.NOT_ELIGIBLE]
            if await self._binary.refusals(scope, plan):
                return [Outcome.NOT_ELIGIBLE]
        watch = _watch(candidate)
        chain.trace_id = watch.trace_id
        # The fused claim (ADR 0003): the claim transaction also moves the step
        # Claimed -> Running, so the fence comes back Running.
        claimed = await self.store.claim(
            org_id, candidate, lease_owner=self.owner, trace_id=watch.trace_id, running=True
        )
        if isinstance(claimed, NotEligible):
            watch.lost(claimed.reason)
            return [Outcome.NOT_ELIGIBLE]
        with watch.attempt(
            claimed.flow_run_id,
            claimed.step_execution_id,
            claimed.attempt_id,
            claimed.attempt_number,
        ) as finish:
            outcome = await self._claimed(org_id, claimed, chain)
            finish(outcome.value)
        return await self._continued(org_id, candidate, chain, [outcome])

    async def process_preclaimed(
        self,
        wake: PreClaimedWake,
        *,
        admission: AdmissionController | None = None,
        ticket: Ticket | None = None,
    ) -> list[Outcome]:
        """Execute a woken step its resolution's transaction already claimed and made
        Running for this process (the pre-claimed wake, ``docs/adr/0007``): no
        candidate, no claim transaction — the ordinary path from the preparation read on
        (which reads the input checkpoint), then the run's continuation chain as after
        any claim. ``ticket``: the admission the resolution reserved for it (released
        when the chain ends, like :meth:`process_found`'s)."""
        crash_point(CrashPoint.AFTER_PRECLAIMED_WAKE, wake.plan_step_key)
        candidate, fence = wake.candidate, wake.fence
        if admission is None or ticket is None:
            return await self._preclaimed(wake.org_id, candidate, fence, None)
        outcomes = [Outcome.NOT_ELIGIBLE]
        try:
            with admitted(ticket):
                held = ticket
                outcomes = await self._preclaimed(
                    wake.org_id,
                    candidate,
                    fence,
                    lambda lane: admission.may_continue(held, lane),
                )
        finally:
            for earlier in outcomes[:-1]:
                admission.observe(earlier.value)
            admission.release(ticket, outcomes[-1].value)
        return outcomes

    async def _preclaimed(
        self,
        org_id: str,
        candidate: Candidate,
        fence: LeaseFence,
        gate: Callable[[str], bool] | None,
    ) -> list[Outcome]:
        watch = _watch(candidate)
        chain = _Chain(self._continuation_limit, watch.trace_id, gate=gate)
        with watch.attempt(
            fence.flow_run_id, fence.step_execution_id, fence.attempt_id, fence.attempt_number
        ) as finish:
            outcome = await self._running(org_id, fence, chain)
            finish(outcome.value)
        return await self._continued(org_id, candidate, chain, [outcome])

    def serves(self, queue_class: str) -> bool:
        """Whether this worker claims steps of ``queue_class``."""
        return queue_class in self._queues

    def preclaim_plan(self, org_id: str, plan_id: str) -> ExecutionPlan | None:
        """The plan of a step this worker may take pre-claimed (ADR 0007), decided in
        memory inside a resolution's transaction: the plan is cached here and, with a
        binary check, this binary's cached verdict on it is clear (§8.4); ``None``
        otherwise (the ordinary claim path then checks before it claims)."""
        cached = self._plans.get((org_id, plan_id))
        if cached is None:
            return None
        plan = cached[1]
        if self._binary is not None and not self._binary.cleared(plan):
            return None
        return plan

    async def _continued(
        self, org_id: str, candidate: Candidate, chain: _Chain, done: list[Outcome]
    ) -> list[Outcome]:
        """Run the steps the chain's commits continued (ADR 0002) after ``done``."""
        while chain.next is not None:
            # The commit that returned also claimed the run's next step for this worker
            # and made it Running (the continuation); it is ours until it commits, rolls
            # back or its lease expires — never dropped.
            fence, nxt, known = chain.next
            chain.next = None
            crash_point(CrashPoint.AFTER_CONTINUATION, nxt.plan_step_key)
            watch = _continued_watch(candidate, nxt)
            with watch.attempt(
                fence.flow_run_id, fence.step_execution_id, fence.attempt_id, fence.attempt_number
            ) as finish:
                outcome = await self._running(org_id, fence, chain, known)
                finish(outcome.value)
            done.append(outcome)
        return done

    async def _claimed(self, org_id: str, fence: LeaseFence, chain: _Chain) -> Outcome:
        # Claim and Running committed together (ADR 0003): both named points mark the one
        # window between that commit and the step's preparation.
        crash_point(CrashPoint.AFTER_CLAIM_COMMIT)
        crash_point(CrashPoint.AFTER_RUNNING_COMMIT)
        return await self._running(org_id, fence, chain)

    async def _running(
        self, org_id: str, fence: LeaseFence, chain: _Chain, known: _Known | None = None
    ) -> Outcome:
        try:
            return await self._execute(org_id, fence, chain, known)
        except FenceLostError:
            log.info("fence lost on %s; abandoning", fence.step_execution_id)
            return Outcome.FENCE_LOST

    async def _execute(
        self, org_id: str, fence: LeaseFence, chain: _Chain, known: _Known | None
    ) -> Outcome:
        try:
            # Everything before the business transaction runs under the periodic
            # heartbeat (§12.3); a heartbeat that loses the fence raises FenceLostError
            # here and the step is abandoned without any commit.
            prepared = await self._with_heartbeat(
                org_id, fence, self._prepare(org_id, fence, known)
            )
        except _Abort as abort:
            if abort.retry:
                return await self._retry(org_id, fence, abort.code)
            return await self._fail(org_id, fence, abort.code)
        if self._hook is not None:
            await self._hook("executed", fence, None)
        if known is not None:
            prepared = evolve(prepared, input_sequence=known.sequence)
        return await self._commit(org_id, fence, prepared, chain)

    async def _prepare(self, org_id: str, fence: LeaseFence, known: _Known | None) -> _Prepared:
        """Load plan, step and input checkpoint; interpret a pure step (no transaction,
        no connection held, §12.2 step 4). A continued step (``known``) takes them from
        the commit that continued it instead of reading them back.

        Raises:
            _Abort: a classified failure, recorded after the heartbeat stopped.
        """
        if fence.input_checkpoint_id is None:
            raise _Abort("input_checkpoint_missing")
        try:
            if known is None:
                # One read-only statement for the run's plan, the step row and the input
                # checkpoint (payload and verification set).
                async with transaction(self._engine, readonly=True) as conn:
                    plan_id, step_row, payload, verification = await _step_input_txn(
                        conn, org_id, fence, fence.input_checkpoint_id
                    )
            else:
                plan_id, step_row = known.plan_id, known.step
                payload, verification = known.payload, known.verification
            # The immutable plan is cached per worker.
            scope, plan, policy_version = await self._plan(org_id, plan_id)
            step = plan.step(step_row.plan_step_key)
            step_entered(step.key, fence.step_execution_id, fence.attempt_number)
        except (NotFoundError, KeyError):
            # Deleted meanwhile (the fence will fail too) or a plan that lost its step.
            raise _Abort("plan_step_missing") from None
        snapshots = parse_set(verification)
        context: dict[str, Any] = json.loads(payload) or {}
        outcome: StepOutcome | None = None
        view: RecordView | None = None
        if self._identity is not None:
            # §17.2: reauthorize per the step's declared principal before any business
            # transaction; a denial is the fault path (committed as the step's outcome)
            # or a terminal StepFault with the safe reason code.
            try:
                denied = await self._identity.reauthorize(org_id, fence, plan, step, context)
            except StepFault as fault:
                raise _Abort(fault.code) from None
            if denied is not None:
                return _Prepared(plan, step, context, snapshots, denied, None, plan_id=plan_id)
        if step.kind is StepKind.DEPENDENCY_WAIT and self._waits is not None:
            # §14: enter the wait (dependency inserted with the commit) or resume it.
            try:
                outcome, wait = await self._waits.prepare(
                    org_id, fence, scope, plan, policy_version, step, context
                )
            except StepFault as fault:
                raise _Abort(fault.code) from None
            return _Prepared(plan, step, context, snapshots, outcome, None, wait, plan_id=plan_id)
        if step.kind in _EFFECT_KINDS and self._effects is not None:
            # §15.1/§15.2: the submit's payload and identities are computed here, before
            # its transaction; a completion reads and validates its consumed receipt.
            try:
                outcome, submit = await self._effects.prepare(
                    org_id,
                    fence,
                    scope,
                    plan,
                    policy_version,
                    step,
                    context,
                    step_row.invocation_ordinal,
                )
            except StepFault as fault:
                raise _Abort(fault.code) from None
            return _Prepared(
                plan, step, context, snapshots, outcome, None, effect=submit, plan_id=plan_id
            )
        if needs_transaction(step):
            try:
                view = await self._views.view_for(scope)
            except FlowError:
                log.warning("no record view for %s; retrying later", org_id, exc_info=True)
                raise _Abort("metadata_view_unavailable", retry=True) from None
        else:
            if self._hook is not None:
                await self._hook("compute", fence, None)
            try:
                outcome = await interpret(plan, step, context, meter=meter_for(plan, step))
            except StepFault as fault:
                raise _Abort(fault.code) from None
        return _Prepared(plan, step, context, snapshots, outcome, view, plan_id=plan_id)

    async def _with_heartbeat(
        self, org_id: str, fence: LeaseFence, work: Coroutine[Any, Any, _Prepared]
    ) -> _Prepared:
        """Run ``work`` while a concurrent task extends the lease every heartbeat period.

        ``work`` runs in the calling task; the heartbeat task is started only once
        ``work`` has run one period (most steps finish well within one, and pay a timer
        instead of two tasks). The heartbeat is stopped (never cancelled
        mid-transaction) once ``work`` ends. A transient heartbeat error is logged and
        retried next period (the commit does not depend on it); a lost fence cancels
        ``work`` and raises — a cancellation from outside stays a cancellation.

        Raises:
            FenceLostError: the heartbeat found the lease expired or fenced.
        """
        if not self._heartbeat:
            return await work
        caller = asyncio.current_task()
        if caller is None:  # pragma: no cover - always called from a task
            raise InvariantError("the heartbeat needs the calling task")
        stop = asyncio.Event()  # set once ``work`` ended: a lost fence cancels nothing then
        lost: list[FenceLostError] = []
        beater: asyncio.Task[None] | None = None
        cancelled = False  # the heartbeat cancelled ``work`` (the caller's task)

        async def beat() -> None:
            nonlocal cancelled
            current = fence
            while True:
                try:
                    current = await self.store.extend_lease(org_id, current)
                    if self._hook is not None:
                        await self._hook("heartbeat", current, None)
                except FenceLostError as exc:
                    lost.append(exc)
                    if not stop.is_set():
                        cancelled = True
                        caller.cancel()
                    return
                except Exception:
                    log.warning("heartbeat of %s failed", fence.step_execution_id, exc_info=True)
                try:
                    await asyncio.wait_for(stop.wait(), self._beat_s)
                    return
                except TimeoutError:
                    pass

        def start() -> None:
            nonlocal beater
            if not stop.is_set():
                beater = asyncio.ensure_future(beat())

        timer = asyncio.get_running_loop().call_later(self._beat_s, start)
        failure: Exception | None = None
        try:
            prepared = await work
        except asyncio.CancelledError:
            # The heartbeat's own cancellation becomes its FenceLostError (below); one
            # from outside (too) stays a cancellation.
            if not cancelled:
                raise
            cancelled = False
            if caller.uncancel() > 0:
                raise
        except Exception as exc:
            failure = exc  # a lost fence, if any, is what is reported (below)
        finally:
            stop.set()
            timer.cancel()
            if beater is not None:
                # A heartbeat in flight finishes its transaction (never cancelled in it).
                await asyncio.gather(beater, return_exceptions=True)
        if cancelled:  # ``work`` swallowed the cancellation
            caller.uncancel()
        if lost:
            log.info("heartbeat lost the fence of %s; abandoning", fence.step_execution_id)
            raise lost[0]
        if failure is not None:
            raise failure
        return prepared

    async def _commit(
        self, org_id: str, fence: LeaseFence, prepared: _Prepared, chain: _Chain
    ) -> Outcome:
        if self._changes is None:
            return await self._commit_once(org_id, fence, prepared, [], chain)
        with self._changes.collect() as signals:
            outcome = await self._commit_once(org_id, fence, prepared, signals, chain)
        return outcome

    async def _commit_once(
        self,
        org_id: str,
        fence: LeaseFence,
        prepared: _Prepared,
        signals: list[Any],
        chain: _Chain,
    ) -> Outcome:
        plan, step, context = prepared.plan, prepared.step, prepared.context
        outcome, view, snapshots = prepared.outcome, prepared.view, prepared.snapshots
        key = step.key
        began = time.perf_counter()
        continued: tuple[LeaseFence, NextStep, _Known] | None = None
        self.last_committed_root = None
        try:
            async with transaction(self._engine) as conn:
                read: list[ReadToken] = []
                admitted: list[LockPlan] = []
                if outcome is None:
                    outcome = await interpret(
                        plan,
                        step,
                        context,
                        reader=_reader(conn, org_id, read),
                        query=None if view is None else _query(conn, org_id, view, read),
                        meter=meter_for(plan, step),
                    )
                # BEGIN has run (on MySQL with the step's first read): §22.2 "after begin".
                crash_point(CrashPoint.AFTER_STEP_BEGIN, key)
                verify = _verifier(conn, org_id, tokens_for(snapshots, step.verifies))
                results = []
                # A lone mutation's writes wait for the lifecycle locks and go out in the
                # commit's round trip (§12.2 steps 9-11, ADR 0011).
                business: list[Write] = []
                # The lifecycle locking read may ride in the business lock's round trip
                # (ADR 0011's amendment); the commit reads it itself otherwise.
                lifecycle = self.store.lifecycle_lock(conn.dialect, org_id, fence)
                if outcome.intents:
                    if view is None:
                        raise InvariantError("a mutation step was prepared without a view")
                    # §12.2 steps 6-7: snapshot tokens are re-read under lock once the
                    # declared business locks are held, before any write or lifecycle lock.
                    results = await apply_intents_txn(
                        conn,
                        org_id,
                        view,
                        outcome.intents,
                        actor=Actor("flow_run", fence.flow_run_id),
                        lineage=Lineage(
                            fence.flow_run_id, fence.step_execution_id, fence.attempt_id
                        ),
                        before_writes=verify,
                        declared=step.resources,
                        observed=_first_versions(read),
                        admitted=admitted,
                        changes=self._changes,
                        defer=business,
                        lifecycle=lifecycle,
                    )
                elif verify is not None:
                    await verify()
                if step.kind is StepKind.VERIFIED_SNAPSHOT_READ:
                    verification = merge_tokens(snapshots, step.key, read)
                else:
                    written = {
                        (r.record.object_name, r.record.record_id): r.record.version
                        for r in results
                    }
                    verification = refresh_tokens(snapshots, written)
                if self._hook is not None:
                    await self._hook("in_txn", fence, conn)
                crash_point(CrashPoint.BEFORE_STEP_FENCE, key)
                committed = await self.store.commit_step_txn(
                    conn,
                    org_id,
                    fence,
                    output=_output(outcome, verification),
                    advance=outcome.advance,
                    evidence=_lock_plan_evidence(admitted),
                    input_sequence=prepared.input_sequence,
                    continue_as=self._continue_as(prepared, outcome, chain),
                    tail=self._tail(prepared),
                    business=business,
                    lifecycle=lifecycle,
                    # Nothing runs in this transaction after the commit's writes: they
                    # carry its COMMIT where the backend allows (ADR 0014), and the named
                    # point fires right before the COMMIT goes out, however it is sent.
                    final=True,
                    before_commit=lambda: crash_point(CrashPoint.BEFORE_STEP_COMMIT, key),
                )
                continued = await self._continue_txn(
                    conn, org_id, fence, prepared, outcome, committed, chain
                )
            raise_connection_lost_after_commit(CrashPoint.AFTER_STEP_COMMIT, key)
            self.last_committed_root = committed.root
            metrics().step_transaction(plan.profile.value, step.kind.value, _since(began))
        except StepFault as fault:  # rolled back before any lifecycle write
            return await self._fail(org_id, fence, fault.code)
        except FenceLostError:
            log.info("final fence lost on %s; business writes rolled back", key)
            return Outcome.FENCE_LOST
        except CommitOutcomeUnknownError:
            lost = await self._quarantine(org_id, fence, AttemptOutcome.COMMIT_UNKNOWN)
            if lost is Outcome.ALREADY_COMMITTED:
                # The commit is proven durable, and the continuation was written by the
                # same transaction: the continued step is ours (its fence still decides).
                chain.next = continued
            return lost
        except LateResourceDiscoveryError as exc:
            # §13.3 steps 1 and 4: record the safe resource-class mismatch and the expanded
            # plan (proven within the declared bounds) with the rolled-back attempt.
            return await self._retry(
                org_id, fence, "late_resource_discovery", _discovery_evidence(exc)
            )
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
        if signals and self._changes is not None:
            await self._changes.flush(list(signals))  # §14.2 step 2, after the commit
        if prepared.wait is not None and self._waits is not None:
            await self._waits.after_commit(prepared.wait)  # §14.2 step 4
        if prepared.effect is not None and self._effects is not None:
            await self._effects.after_commit(prepared.effect)
        chain.next = continued
        return Outcome.COMMITTED

    def _tail(self, prepared: _Prepared) -> CommitTail | None:
        """The step's own rows after its transition, in the commit's round trip: a wait's
        dependency (§14: it commits with the wait transition and the checkpoint that is
        the resume point), an effect's dependency, outbox message and link (§15.1 step
        4, last)."""
        if prepared.wait is not None and prepared.effect is not None:
            raise InvariantError("a step is a wait or an effect submit, never both")
        if prepared.wait is not None and self._waits is not None:
            return self._waits.commit_tail(prepared.wait)
        if prepared.effect is not None and self._effects is not None:
            return self._effects.commit_tail(prepared.effect)
        return None

    def _continue_as(
        self, prepared: _Prepared, outcome: StepOutcome, chain: _Chain
    ) -> ContinueAs | None:
        """Ask the commit to claim the run's next step (step continuation, fused into
        the commit's writes — ADR 0002/0003) when the chain has room, the step advances
        the run to a new step of a lane this worker serves, and it carries no wait or
        effect of its own. Admission's ``gate`` is asked by the commit once its fence
        held."""
        advance = outcome.advance
        if (
            chain.remaining <= 0
            or not isinstance(advance, NextStep)
            or advance.queue_class not in self._queues
            or prepared.wait is not None
            or prepared.effect is not None
            or not prepared.plan_id
        ):
            return None
        return ContinueAs(self.owner, chain.trace_id, chain.gate)

    async def _continue_txn(
        self,
        conn: AsyncConnection,
        org_id: str,
        fence: LeaseFence,
        prepared: _Prepared,
        outcome: StepOutcome,
        committed: CommitResult,
        chain: _Chain,
    ) -> tuple[LeaseFence, NextStep, _Known] | None:
        """The continuation the commit wrote (:meth:`_continue_as`), if any."""
        advance = outcome.advance
        claimed = committed.continued
        if claimed is None or not isinstance(advance, NextStep) or not prepared.plan_id:
            return None
        if committed.context_json is None:
            raise InvariantError("a continued commit publishes its checkpoint payload")
        chain.remaining -= 1
        raw = committed.read_verification_json
        known = _Known(
            plan_id=prepared.plan_id,
            step=_StepRow(advance.plan_step_key, advance.step_kind, advance.invocation_ordinal),
            payload=committed.context_json,
            verification=None if raw is None else json.loads(raw),
            sequence=committed.output_checkpoint.sequence,
        )
        return claimed, advance, known

    # --- outcomes ------------------------------------------------------------------------

    async def _retry(
        self,
        org_id: str,
        fence: LeaseFence,
        code: str,
        evidence: Mapping[str, Any] | None = None,
    ) -> Outcome:
        return await self._rollback(
            org_id,
            fence,
            StepFailure(FailureClass.RETRYABLE, code, evidence=evidence),
            Outcome.RETRY_SCHEDULED,
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
            attempt_retried(failure.safe_error_code)
            return ok
        if isinstance(decision, RetryExhausted):
            attempt_exhausted()
            return Outcome.FAILED
        return Outcome.FENCE_LOST  # cancellation won

    async def _quarantine(self, org_id: str, fence: LeaseFence, outcome: AttemptOutcome) -> Outcome:
        # The connection that lost the business COMMIT is gone; the quarantine transaction
        # opens a new one, which can itself be lost *before* its COMMIT while a failed node
        # is still being routed around. Nothing of it committed then, and the decision is
        # fenced, so it is tried again (bounded); past that, lease expiry recovers the step.
        for attempt in range(1, _QUARANTINE_ATTEMPTS + 1):
            try:
                decision = await self.store.quarantine_commit_unknown(org_id, fence, outcome)
                break
            except FenceLostError:
                return Outcome.FENCE_LOST
            except CommitOutcomeUnknownError:
                raise
            except Exception as exc:
                lost = classify_db_error(exc) is DbErrorClass.OUTCOME_UNKNOWN
                if not lost or attempt == _QUARANTINE_ATTEMPTS:
                    raise
                log.warning(
                    "quarantine of step %s: connection lost before COMMIT; retrying",
                    fence.step_execution_id,
                )
                await asyncio.sleep(0.2 * attempt)
        if isinstance(decision, AlreadyCommitted):
            return Outcome.ALREADY_COMMITTED
        if isinstance(decision, Quarantined):
            return Outcome.QUARANTINED
        return Outcome.FENCE_LOST  # cancellation won

    # --- helpers -------------------------------------------------------------------------

    async def _plan(
        self, org_id: str, plan_id: str
    ) -> tuple[TrustedRuntimeWorkScope, ExecutionPlan, int]:
        key = (org_id, plan_id)
        cached = self._plans.get(key)
        if cached is not None:
            self._plans.move_to_end(key)
            return cached
        async with transaction(self._engine, readonly=True) as conn:
            row = await get_plan_txn(conn, org_id, plan_id)
        if row is None:
            raise NotFoundError("execution_plan", plan_id)
        value = (row.scope, row.plan(), row.policy_version)
        self._plans[key] = value
        while len(self._plans) > _MAX_CACHED_PLANS:
            self._plans.popitem(last=False)
        return value


def _watch(candidate: Candidate) -> StepWatch:
    return StepWatch(
        lane=candidate.queue_class,
        profile=candidate.execution_profile,
        step_kind=candidate.step_kind,
        trace_context=candidate.trace_context,
        run_after=candidate.run_after,
    )


def _continued_watch(candidate: Candidate, nxt: NextStep) -> StepWatch:
    """The watch of a continued step: the run's profile and trace, the step's own lane
    and kind; no queue wait (it never waited in a queue)."""
    return StepWatch(
        lane=nxt.queue_class,
        profile=candidate.execution_profile,
        step_kind=nxt.step_kind,
        trace_context=candidate.trace_context,
        run_after=None,
    )


@dataclass
class _Chain:
    """One :meth:`StepWorker.process_chain` call's continuation state: how many more
    steps it may continue, the run's trace id, and the continued step the last commit
    claimed for this worker (Running, with its fence) — taken by the chain loop."""

    remaining: int
    trace_id: str | None
    next: tuple[LeaseFence, NextStep, _Known] | None = None
    gate: Callable[[str], bool] | None = None


@dataclass(frozen=True)
class _Known:
    """A continued step's input as the commit that continued it wrote it: the run's plan,
    the new step row and the output checkpoint (canonical JSON) — what the preparation
    read would return, so it is not read back (ADR 0002)."""

    plan_id: str
    step: _StepRow
    payload: str
    verification: Any
    #: The output checkpoint's sequence: the run's latest at the continued fence's root
    #: version (``commit_step_txn``'s ``input_sequence``).
    sequence: int | None = None


def _since(began: float) -> float:
    return time.perf_counter() - began


@dataclass(frozen=True)
class _Prepared:
    """A step ready for its business transaction (``outcome`` set for pure steps)."""

    plan: ExecutionPlan
    step: PlanStep
    context: dict[str, Any]
    snapshots: Mapping[str, Sequence[ReadToken]]
    outcome: StepOutcome | None
    view: RecordView | None
    wait: PreparedWait | None = None
    effect: PreparedSubmit | None = None
    #: The run's plan (a continued step of the run is prepared with it).
    plan_id: str = ""
    #: A continued step's input checkpoint sequence (``_Known.sequence``).
    input_sequence: int | None = None


def _step_input() -> Any:
    """The preparation's read of a claimed step's input, built once at import (issue 13)::

        SELECT r.plan_id, s.plan_step_key, s.step_kind, s.invocation_ordinal,
               c.context_payload, c.read_verification_set
        FROM flow_runs r
        JOIN flow_step_executions s ON s.org_id = r.org_id AND s.step_execution_id = :step
        JOIN flow_checkpoints c ON c.org_id = r.org_id AND c.flow_run_id = r.flow_run_id
                               AND c.checkpoint_id = :checkpoint
        WHERE r.org_id = :org AND r.flow_run_id = :run AND NOT r.is_deleted

    Three primary-key lookups in one statement instead of three — the live run (as
    ``get_run_txn`` read it: org, id, not soft-deleted), the step by the trusted org and
    its own id, the checkpoint by the org, the run and its id. No lookup goes through
    another row's columns beyond those keys (each is bound to the same values the
    single reads bound), so a row exists exactly when all three reads found theirs."""
    r, s, c = flow_runs.c, flow_step_executions.c, flow_checkpoints.c
    joined = flow_runs.join(
        flow_step_executions,
        (s.org_id == r.org_id)
        & (s.step_execution_id == bindparam("step", type_=s.step_execution_id.type)),
    ).join(
        flow_checkpoints,
        (c.org_id == r.org_id)
        & (c.flow_run_id == r.flow_run_id)
        & (c.checkpoint_id == bindparam("checkpoint", type_=c.checkpoint_id.type)),
    )
    return (
        select(
            r.plan_id,
            s.plan_step_key,
            s.step_kind,
            s.invocation_ordinal,
            c.context_payload,
            c.read_verification_set,
        )
        .select_from(joined)
        .where(
            r.org_id == bindparam("org", type_=r.org_id.type),
            r.flow_run_id == bindparam("run", type_=r.flow_run_id.type),
            r.is_deleted == false(),
        )
    )


_STEP_INPUT = _step_input()


async def _step_input_txn(
    conn: AsyncConnection, org_id: str, fence: LeaseFence, checkpoint_id: str
) -> tuple[str, _StepRow, str, Any]:
    """The run's plan id, the step row and the input checkpoint's context payload and
    ReadVerificationSet (decoded) of a claimed step, in one statement — the last of the
    caller's read-only transaction (its round trip carries the ``COMMIT``).

    Raises:
        NotFoundError: the run (or it is soft-deleted), the step or the checkpoint is
            missing in ``org_id`` — what each single read raised.
    """
    params = {
        "org": org_id,
        "run": fence.flow_run_id,
        "step": fence.step_execution_id,
        "checkpoint": checkpoint_id,
    }
    # The read-only transaction's only statement: it carries its COMMIT (ADR 0013).
    [rows] = await execute_reads(conn, [Read(_STEP_INPUT, params)], commit=True)
    row = rows[0] if rows else None
    if row is None:
        raise NotFoundError("flow_step_execution", fence.step_execution_id)
    raw = row[5]
    verification = json.loads(raw) if isinstance(raw, str | bytes) else raw
    # A LegacyInterpreter-owned run has no plan (NULL), as ``run_from_row`` reads it.
    step = _StepRow(str(row[1]), str(row[2]), int(row[3]))
    return str(row[0] or ""), step, str(row[4]), verification


class _Abort(Exception):
    """A classified failure found before the business transaction."""

    def __init__(self, code: str, *, retry: bool = False) -> None:
        super().__init__(code)
        self.code = code
        self.retry = retry


def _reader(
    conn: AsyncConnection, org_id: str, tokens: list[ReadToken]
) -> Callable[[str, str], Awaitable[RecordState | None]]:
    """A current read inside the step transaction that also records the version it
    observed (kept as verification tokens only by a ``VerifiedSnapshotRead`` step)."""

    async def read(object_name: str, record_id: str) -> RecordState | None:
        state = await read_record_txn(conn, org_id, object_name, record_id)
        tokens.append(ReadToken(object_name, record_id, None if state is None else state.version))
        return state

    return read


def _first_versions(tokens: Sequence[ReadToken]) -> dict[tuple[str, str], int]:
    """The first version the step saw of each record it read (a later read of the same
    row in READ COMMITTED may see a newer one; the earliest is what values derive from)."""
    out: dict[tuple[str, str], int] = {}
    for t in tokens:
        if t.version is not None:
            out.setdefault((t.object_name, t.record_id), t.version)
    return out


def _query(
    conn: AsyncConnection, org_id: str, view: RecordView, tokens: list[ReadToken]
) -> RecordQuery:
    """The step's lookup query, recording the versions it observed (like :func:`_reader`)."""
    inner = record_query(conn, org_id, view)

    async def query(object_name: str, field: str, value: str, limit: int) -> list[RecordState]:
        found = await inner(object_name, field, value, limit)
        tokens.extend(ReadToken(r.object_name, r.record_id, r.version) for r in found)
        return found

    return query


def _verifier(
    conn: AsyncConnection, org_id: str, tokens: Sequence[ReadToken]
) -> Callable[[], Awaitable[None]] | None:
    if not tokens:
        return None

    async def verify() -> None:
        await verify_tokens_txn(conn, org_id, tokens)

    return verify


#: Lock-plan digests by the plan's content (:func:`_lock_plan_digest`), oldest first.
_LOCK_PLAN_DIGESTS: OrderedDict[tuple[Any, ...], str] = OrderedDict()
#: Distinct lock plans whose digests are kept.
_MAX_CACHED_LOCK_PLANS = 1024


def _lock_plan_digest(plan: LockPlan) -> str:
    """``plan.digest()``, memoized by the plan's content — its keys, each key's roles and
    its created keys, exactly what ``LockPlan.to_dict`` (the digested form) is made of:
    the steps of a run that mutate the same record commit with the same plan, and the
    canonical JSON and SHA-256 of it were paid again at every commit (issue 13)."""
    content = (plan.keys, tuple(plan.roles[k] for k in plan.keys), plan.creates)
    digest = _LOCK_PLAN_DIGESTS.get(content)
    if digest is None:
        digest = _LOCK_PLAN_DIGESTS[content] = plan.digest()
        # First in, first out; each step only reads or adds, so workers on other
        # threads' event loops cannot trip over one another's eviction.
        while len(_LOCK_PLAN_DIGESTS) > _MAX_CACHED_LOCK_PLANS:
            try:
                _LOCK_PLAN_DIGESTS.popitem(last=False)
            except KeyError:
                break
    return digest


def _lock_plan_evidence(admitted: Sequence[LockPlan]) -> dict[str, Any] | None:
    """The lock plan a mutation step committed with (its attempt's metrics summary)."""
    if not admitted:
        return None
    plan = admitted[0]
    return {"lock_plan_digest": _lock_plan_digest(plan), "lock_plan_keys": len(plan.keys)}


def _discovery_evidence(exc: LateResourceDiscoveryError) -> dict[str, Any]:
    """Safe evidence of a late discovery: the resource class and role that did not match
    the admitted plan, and the expanded plan the retry runs under (no record ids)."""
    out: dict[str, Any] = {
        "late_discovery": {
            "resource_class": exc.resource_key.resource_class.name,
            "role": None if exc.role is None else exc.role.value,
        }
    }
    if exc.expanded_plan is not None:
        out["expanded_lock_plan_digest"] = exc.expanded_plan.digest()
        out["expanded_lock_plan_keys"] = len(exc.expanded_plan.keys)
    return out


def _output(outcome: StepOutcome, verification: Any = None) -> CheckpointInput:
    context = dict(outcome.context)
    advance = outcome.advance
    cursor = {"next_step": advance.plan_step_key} if isinstance(advance, NextStep | HandOff) else {}
    if isinstance(advance, FinishRun | FailRun):
        # The run's output is the final variables, recorded once with the terminal commit.
        variables = context.get("variables") or {}
        context[RUN_OUTPUT_KEY] = {k: v for k, v in variables.items() if not k.startswith("$")}
    return CheckpointInput(context=context, plan_cursor=cursor, read_verification_set=verification)


def _rotation(engine: AsyncEngine, batch: int) -> OrgRotation:
    async def source(after: str | None, limit: int) -> list[str]:
        return await orgs_with_work(engine, after=after, limit=limit)

    return OrgRotation(source, batch=batch)


class Sweeper:
    """Lease recovery (§12.4) and cancellation cleanup (§11.1), bounded per org; each
    pass serves the next batch of orgs with work (in rotation, like the workers)."""

    def __init__(
        self,
        engine: AsyncEngine,
        store: FlowRunStateStore,
        *,
        limit: int = 100,
        org_batch: int = 100,
    ) -> None:
        self._engine = engine
        self.store = store
        self._limit = limit
        self._orgs = _rotation(engine, org_batch)

    async def sweep_org(self, org_id: str) -> tuple[int, int]:
        """Recover expired leases, then complete pending cancellations of ``org_id``;
        returns ``(recovered, cancelled)``."""
        expired = await self.store.expired_leases(org_id, limit=self._limit)
        recovered = 0
        for lease in expired:
            # Between the non-locking scan and the fenced recovery transaction.
            crash_point(CrashPoint.DURING_RECOVERY)
            decision = await self.store.recover_step(
                org_id, lease.flow_run_id, lease.step_execution_id
            )
            if not isinstance(decision, NoChange):
                recovered += 1
        metrics().leases_expired(recovered)
        cancelled = 0
        for run_id in await self.store.pending_cancellations(org_id, limit=self._limit):
            if isinstance(await self.store.complete_cancel(org_id, run_id), CancelCompleted):
                cancelled += 1
        return recovered, cancelled

    async def sweep_once(self) -> tuple[int, int]:
        """One bounded pass over the next batch of orgs with active runs."""
        total = (0, 0)
        for org_id in await self._orgs.next_batch():
            r, c = await self.sweep_org(org_id)
            total = (total[0] + r, total[1] + c)
        return total
