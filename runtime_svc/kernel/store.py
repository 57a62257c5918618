"""``FlowRunStateStore``: the only write path for FlowRun, FlowStepExecution,
FlowStepAttempt and FlowCheckpoint rows (§10.1 "the only write boundary"; issue 5).

Shape (STYLE 5-7): every transition locks the lifecycle rows it needs in the §12 order
(root, step, attempt) with ``SELECT … FOR UPDATE``, hands the snapshots to a pure
``decide_*`` function from :mod:`runtime_svc.kernel.transitions`, and applies the
returned decision as conditional UPDATEs whose row count must be 1
(:func:`runtime_svc.kernel.store_rows.apply_transition`). A lost fence raises
:class:`~services.errors.FenceLostError` and rolls the whole transaction back; ordinary
domain outcomes (not eligible, nothing to recover, cancellation won) are returned as
values.

Each ``*_txn`` method runs in the caller's connection and composes with other helpers
in one transaction — :meth:`FlowRunStateStore.commit_step_txn` is called by the worker
*inside its business transaction* after its business locks (§12.2 steps 9-13). Each
public method without the suffix opens exactly one transaction
(``services.db.run_in_transaction``: whole-transaction retry on deadlocks, never on a
lost COMMIT).

Every method takes the trusted ``org_id`` first, and a :class:`LeaseFence` is checked
against it before any SQL. Durable times come from the database clock (``db_now``); the
``clock`` constructor argument exists so tests can shift it, never to use a worker clock.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import Dialect
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.kernel.applied import (
    applied_run,
    applied_step,
    inserted_attempt,
    inserted_step,
    projected_step_state,
)
from runtime_svc.kernel.checkpoint_guard import DEFAULT_MAX_CHECKPOINT_BYTES
from runtime_svc.kernel.decisions import (
    Advance,
    AlreadyCommitted,
    CancelCompleted,
    CancelRecorded,
    CancelWon,
    Claimed,
    ClaimRequest,
    FenceLost,
    NextStep,
    NoChange,
    NotEligible,
    Quarantined,
    Recovered,
    RecoveryTerminal,
    RetryExhausted,
    RetryScheduled,
    StepFailure,
    Tombstoned,
    WaitExpired,
    WaitResolved,
    validate_fence_input,
)
from runtime_svc.kernel.errors import StateVersionMismatchError, TransitionInputError
from runtime_svc.kernel.model import (
    AttemptRecord,
    CheckpointInput,
    CheckpointMeta,
    LeaseFence,
    RunRecord,
    StepPatch,
    StepRecord,
    Transition,
)
from runtime_svc.kernel.policy import (
    DEFAULT_RETRY_POLICY,
    RetryPolicy,
    lease_token_digest,
    new_lease_token,
)
from runtime_svc.kernel.states import AttemptOutcome, RunState, StepState
from runtime_svc.kernel.store_create import (
    ClaimedStart,
    FirstStep,
    InsertClaimed,
    StartRunRequest,
    StartRunResult,
    create_run_txn,
    run_by_idempotency_key_txn,
)
from runtime_svc.kernel.store_reads import (
    DEFAULT_PAGE_SIZE,
    Candidate,
    Checkpoint,
    ExpiredLease,
    RunFilters,
    RunPage,
    SupportView,
    cancel_requested_runs_txn,
    candidate_for_run_txn,
    eligible_work_txn,
    expired_leases_txn,
    get_checkpoint_txn,
    get_run_txn,
    list_runs_page_txn,
    plan_digest_txn,
    support_view_txn,
)
from runtime_svc.kernel.store_rows import (
    PreparedCheckpoint,
    apply_claim_running,
    apply_commit_continued,
    apply_transition,
    checkpoint_insert,
    checkpoint_written,
    count_fenced_attempts,
    execute_deferred,
    extend_lease_row,
    fence_error,
    fenced_locked,
    fenced_read,
    last_checkpoint_sequence,
    lock_fenced,
    lock_latest_attempt,
    lock_root_and_current,
    lock_run,
    lock_run_and_step,
    lock_step,
    new_id,
    prepare_checkpoint,
)
from runtime_svc.kernel.store_waits import (
    cancel_step_dependencies_txn,
    effect_dependency_of_step_txn,
)
from runtime_svc.kernel.transitions import (
    decide_cancel,
    decide_cancel_cleanup,
    decide_claim,
    decide_commit,
    decide_commit_unknown,
    decide_heartbeat,
    decide_recovery,
    decide_resolve_wait,
    decide_rollback_retry,
    decide_start_running,
    decide_wait_expired,
)
from runtime_svc.kernel.transitions_effects import CAUSE_CANCELLED_AFTER_EFFECT
from runtime_svc.kernel.wait_model import DependencyRecord, DependencyState
from runtime_svc.resources import LockPlan
from services.auth import TrustedRuntimeWorkScope
from services.db import db_now, run_in_transaction, transaction
from services.db_batch import Companion, Write
from services.errors import FenceLostError, NotFoundError
from services.evolve import evolve
from services.invariants import InvariantError
from services.telemetry import trace_id_of

__all__ = [
    "EMPTY_LOCK_PLAN_DIGEST",
    "ClaimedStart",
    "Clock",
    "CommitResult",
    "CommitTail",
    "ContinueAs",
    "FirstStep",
    "FlowRunStateStore",
    "RecoveryResult",
    "StartRunRequest",
    "StartRunResult",
]

T = TypeVar("T")


def _effect_succeeded(dep: DependencyRecord) -> bool:
    """Whether a resolved effect-completion dependency recorded a ``SUCCEEDED`` receipt."""
    if dep.state is not DependencyState.RESOLVED or not dep.resolution_receipt:
        return False
    try:
        receipt = json.loads(dep.resolution_receipt)
    except ValueError:
        return False
    return isinstance(receipt, dict) and receipt.get("outcome") == "SUCCEEDED"


#: The database clock (or, in tests, a shifted one).
Clock = Callable[[AsyncConnection], Awaitable[datetime]]
#: ``LockPlanDigest`` of a step that declares no business resources.
EMPTY_LOCK_PLAN_DIGEST = LockPlan().digest()
#: Bound of the per-store cache of immutable plan digests (cleared whole when full).
_MAX_PLAN_DIGESTS = 1024


@dataclass(frozen=True)
class CommitResult:
    """What a successful final commit published."""

    run_state: RunState
    output_checkpoint: CheckpointMeta
    next_step_execution_id: str | None
    #: The database clock of the commit transaction (a continuation claims with it).
    committed_at: datetime | None = None
    #: The output checkpoint's context payload and ReadVerificationSet exactly as
    #: inserted (canonical JSON): the continued step's input, never read back (ADR 0002).
    context_json: str | None = dataclasses.field(default=None, repr=False)
    read_verification_json: str | None = dataclasses.field(default=None, repr=False)
    #: The root as this transaction left it and the next step as it inserted it
    #: (derived in memory, ``kernel.applied``): the continuation decides on them
    #: instead of re-reading rows it holds or wrote (ADR 0002).
    root: RunRecord | None = dataclasses.field(default=None, repr=False)
    next_step: StepRecord | None = dataclasses.field(default=None, repr=False)
    #: With ``continue_as``: the Running fence of the next step this commit claimed
    #: (``None``: not continued — the root and next step above are then as written).
    continued: LeaseFence | None = dataclasses.field(default=None, repr=False)


@dataclass(frozen=True)
class CommitTail:
    """New rows a step's commit writes after its transition, keyed under the held root
    (a wait's dependency; an effect's dependency, outbox message and link), in the
    transition's round trip where the backend batches writes (ADR 0010).

    ``writes(conn, now)``: the rows, given the commit's clock reading; at most one of
    them an insert-if-absent. ``settle(conn, inserted)``: what follows them in the same
    transaction (``inserted`` ``False``: that insert found its row, and the writes after
    it did not run).
    """

    writes: Callable[[AsyncConnection, datetime], Awaitable[Sequence[Write]]]
    settle: Callable[[AsyncConnection, bool], Awaitable[None]]


@dataclass(frozen=True)
class ContinueAs:
    """Ask a final commit to continue its run (ADR 0002, fused per ADR 0003): when it
    advances the root to a new step, claim that step for ``lease_owner`` and make it
    ``Running`` in the same writes. ``admit(queue_class)`` (admission, §16) is asked
    once the commit's fence held, before the claim decision; ``False`` declines."""

    lease_owner: str
    trace_id: str | None = None
    admit: Callable[[str], bool] | None = dataclasses.field(default=None, repr=False)


@dataclass(frozen=True)
class RecoveryResult:
    """One expired lease and what recovery decided for it."""

    flow_run_id: str
    step_execution_id: str
    decision: Recovered | RecoveryTerminal | NoChange


class FlowRunStateStore:
    """Typed, fenced transitions and reads of Flow runs (see module docstring).

    Args:
        engine: the runtime database.
        policy: retry/lease policy selected at claim time.
        ownership_epoch: this scheduler generation's V2 epoch (>= 1).
        max_checkpoint_bytes: bound of one checkpoint context.
        clock: the durable clock; ``services.db.db_now`` unless a test shifts it.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        policy: RetryPolicy = DEFAULT_RETRY_POLICY,
        ownership_epoch: int = 1,
        max_checkpoint_bytes: int = DEFAULT_MAX_CHECKPOINT_BYTES,
        clock: Clock = db_now,
    ) -> None:
        if ownership_epoch < 1:
            raise ValueError("a V2 ownership epoch is >= 1")
        self._engine = engine
        self.policy = policy
        self.ownership_epoch = ownership_epoch
        self.max_checkpoint_bytes = max_checkpoint_bytes
        self._clock = clock
        self._plan_digests: dict[tuple[str, str], str] = {}

    def _check_fence(self, org_id: str, fence: LeaseFence) -> None:
        """Typed input validation before any SQL: org, epoch (this scheduler's), token."""
        validate_fence_input(org_id, fence)
        if fence.ownership_epoch != self.ownership_epoch:
            raise TransitionInputError(
                "fence epoch is not this scheduler's ownership epoch", field="epoch"
            )

    async def _run(self, fn: Callable[[AsyncConnection], Awaitable[T]]) -> T:
        return await run_in_transaction(self._engine, fn)

    async def _read(self, fn: Callable[[AsyncConnection], Awaitable[T]]) -> T:
        async with transaction(self._engine, readonly=True) as conn:
            return await fn(conn)

    # --- runs ----------------------------------------------------------------------------

    async def create_run(
        self, scope: TrustedRuntimeWorkScope, request: StartRunRequest
    ) -> StartRunResult:
        """Accept a run: root (``Runnable``, or ``Accepted`` when not admitted), first
        step ``Pending`` and the immutable input checkpoint, in one transaction."""
        # Validate the input checkpoint before opening the transaction (no SQL for it).
        prepared = prepare_checkpoint(request.input, max_bytes=self.max_checkpoint_bytes)
        return await self._run(
            lambda conn: self.create_run_txn(conn, scope, request, prepared=prepared, last=True)
        )

    async def run_by_key_txn(
        self, conn: AsyncConnection, org_id: str, idempotency_key: str
    ) -> RunRecord | None:
        """The run accepted under ``idempotency_key`` in ``org_id`` (a replayed start
        maps to the run its first application started), or ``None``."""
        return await run_by_idempotency_key_txn(conn, org_id, idempotency_key)

    async def create_run_txn(
        self,
        conn: AsyncConnection,
        scope: TrustedRuntimeWorkScope,
        request: StartRunRequest,
        *,
        prepared: PreparedCheckpoint | None = None,
        last: bool = False,
    ) -> StartRunResult:
        """:meth:`create_run` inside the caller's transaction (see
        :func:`runtime_svc.kernel.store_create.create_run_txn` for the errors,
        ``prepared`` and ``last``: nothing follows in the transaction, the inserts carry
        its ``COMMIT``)."""
        return await create_run_txn(
            conn,
            scope,
            request,
            ownership_epoch=self.ownership_epoch,
            max_checkpoint_bytes=self.max_checkpoint_bytes,
            clock=self._clock,
            prepared=prepared,
            last=last,
        )

    async def create_run_claimed(
        self, scope: TrustedRuntimeWorkScope, request: StartRunRequest, *, lease_owner: str
    ) -> StartRunResult:
        """:meth:`create_run_claimed_txn` in its own transaction."""
        prepared = prepare_checkpoint(request.input, max_bytes=self.max_checkpoint_bytes)
        return await self._run(
            lambda conn: self.create_run_claimed_txn(
                conn, scope, request, lease_owner=lease_owner, prepared=prepared, last=True
            )
        )

    async def create_run_claimed_txn(
        self,
        conn: AsyncConnection,
        scope: TrustedRuntimeWorkScope,
        request: StartRunRequest,
        *,
        lease_owner: str,
        prepared: PreparedCheckpoint | None = None,
        last: bool = False,
    ) -> StartRunResult:
        """:meth:`create_run_txn`, and — for a run this call creates — the ordinary
        fused claim (§12.1 decision, new attempt and lease token, ``Claimed -> Running``,
        ADR 0003) of its first step for ``lease_owner`` in the same transaction, decided
        on the root and step the creation is about to insert (``docs/adr/0005``, amended
        in round 7: the root and step are INSERTed already claimed and ``Running`` —
        no UPDATE of rows this transaction just inserted). The result's ``claimed``
        carries the Running fence and the step's input; it is ``None`` on an idempotent
        replay or when the claim decision refuses (the run is then inserted as by
        :meth:`create_run` and its step waits for an ordinary claim). ``run`` and
        ``step`` of the result are the rows as created *before* the claim, as before.
        ``last``: nothing follows in the transaction (see
        :func:`~runtime_svc.kernel.store_create.create_run_txn`)."""
        token = new_lease_token()

        async def claim(root: RunRecord, step: StepRecord) -> InsertClaimed | None:
            request = await self._claim_request(
                conn,
                scope.org_id,
                root.plan_id,
                token,
                lease_owner=lease_owner,
                lock_plan_digest=EMPTY_LOCK_PLAN_DIGEST,
                trace_id=trace_id_of(root.trace_context),
                expected_root_version=None,
                expected_step_version=None,
            )
            now = step.created_at
            decision = decide_claim(root, step, now, self.policy, request)
            if not isinstance(decision, Claimed):
                return None  # a fresh run cannot refuse; if it did: an ordinary claim later
            fence, running = _claimed_running(
                scope.org_id, root, step, decision, request, token, now
            )
            return InsertClaimed(fence, decision.transition, running)

        return await create_run_txn(
            conn,
            scope,
            request,
            ownership_epoch=self.ownership_epoch,
            max_checkpoint_bytes=self.max_checkpoint_bytes,
            clock=self._clock,
            claim=claim,
            prepared=prepared,
            last=last,
        )

    # --- claim, lifecycle, heartbeat -----------------------------------------------------

    async def claim(
        self,
        org_id: str,
        candidate: Candidate,
        *,
        lease_owner: str,
        lock_plan_digest: str = EMPTY_LOCK_PLAN_DIGEST,
        trace_id: str | None = None,
        running: bool = False,
    ) -> LeaseFence | NotEligible:
        """§12.1: claim the candidate's step; exactly one concurrent claimer wins.

        Returns the worker's :class:`LeaseFence` (holding the only copy of the raw lease
        token) or :class:`NotEligible` — including ``"lost_race"`` when a conditional
        UPDATE found the row already moved, and ``"attempt_budget_spent"`` when the due
        step could never be claimed again: that claim transaction ended the step and the
        run (``retry_exhausted``) instead.

        ``running``: the fused claim (``docs/adr/0003-fused-claim-running.md``) — the
        same transaction also moves the step ``Claimed -> Running`` (§12.2 (3)) and the
        fence comes back with the version the final commit compares, so no
        :meth:`mark_running` transaction follows.
        """
        if candidate.org_id != org_id:
            raise TransitionInputError("candidate belongs to another org", field="org_id")
        token = new_lease_token()

        async def fn(conn: AsyncConnection) -> tuple[LeaseFence, Transition | None] | NotEligible:
            return await self._claim_txn(
                conn,
                org_id,
                candidate.flow_run_id,
                candidate.step_execution_id,
                now=None,  # read with the locks (lock_run_and_step)
                token=token,
                lease_owner=lease_owner,
                lock_plan_digest=lock_plan_digest,
                trace_id=trace_id,
                expected_root_version=candidate.root_state_version,
                expected_step_version=candidate.step_state_version,
                running=running,
                final=True,  # the claim's writes end its transaction (ADR 0014)
            )

        try:
            claimed = await self._run(fn)
        except FenceLostError:  # a conditional UPDATE found the row already moved
            return NotEligible("lost_race")
        return claimed if isinstance(claimed, NotEligible) else claimed[0]

    async def _claim_txn(
        self,
        conn: AsyncConnection,
        org_id: str,
        flow_run_id: str,
        step_execution_id: str,
        *,
        now: datetime | None,
        token: str,
        lease_owner: str,
        lock_plan_digest: str,
        trace_id: str | None,
        expected_root_version: int | None,
        expected_step_version: int | None,
        held: tuple[RunRecord, StepRecord] | None = None,
        running: bool = False,
        final: bool = False,
    ) -> tuple[LeaseFence, Transition | None] | NotEligible:
        """The one claim path (§12.1 steps 3-5) of :meth:`claim` and
        :meth:`continue_txn`: lock root then step, decide, apply. ``held`` is the root
        and step a continuation's transaction already holds and wrote (ADR 0002),
        decided on instead of locked again. ``running``: also decide
        ``decide_start_running`` on the rows the claim leaves (derived in memory) and
        write both in the claim's UPDATEs (ADR 0003); the fence then carries the
        Running version. Returns the fence and, for a claim that won, the transition
        it applied. ``now=None``: the clock is read after the locks, by the same
        statement (:func:`lock_run_and_step`). ``final``: nothing follows the claim's
        writes in the caller's transaction — they carry its ``COMMIT`` where the backend
        allows (ADR 0014)."""
        if held is not None:
            root, step = held
        else:
            locked_root, locked_step = await lock_run_and_step(
                conn, org_id, flow_run_id, step_execution_id
            )
            if locked_root is None or locked_step is None:
                return NotEligible("missing")
            root, step = locked_root, locked_step
        if now is None:
            now = await self._clock(conn)
        request = await self._claim_request(
            conn,
            org_id,
            root.plan_id,
            token,
            lease_owner=lease_owner,
            lock_plan_digest=lock_plan_digest,
            trace_id=trace_id,
            expected_root_version=expected_root_version,
            expected_step_version=expected_step_version,
        )
        decision = decide_claim(root, step, now, self.policy, request)
        if isinstance(decision, NotEligible):
            return decision
        if isinstance(decision, RetryExhausted) or not running:
            await apply_transition(
                conn, org_id, decision.transition, now, rows_locked=True, final=final
            )
            if isinstance(decision, RetryExhausted):
                return NotEligible("attempt_budget_spent")
            return decision.fence(org_id, root.flow_run_id, step, request, token), (
                decision.transition
            )
        fence, running_patch = _claimed_running(org_id, root, step, decision, request, token, now)
        await apply_claim_running(
            conn, org_id, decision.transition, running_patch, now, final=final
        )
        # One UPDATE moved the step by one version, Pending -> Running.
        return fence, decision.transition

    async def _claim_request(
        self,
        conn: AsyncConnection,
        org_id: str,
        plan_id: str,
        token: str,
        *,
        lease_owner: str,
        lock_plan_digest: str,
        trace_id: str | None,
        expected_root_version: int | None,
        expected_step_version: int | None,
    ) -> ClaimRequest:
        """The one shape of a claim request (discovered, continued, created-claimed and
        pre-claimed claims): a new attempt id, ``token``'s digest, this store's epoch
        and the plan's digest."""
        return ClaimRequest(
            attempt_id=new_id("att"),
            lease_owner=lease_owner,
            lease_token_digest=lease_token_digest(token),
            ownership_epoch=self.ownership_epoch,
            plan_digest=await self._plan_digest(conn, org_id, plan_id),
            lock_plan_digest=lock_plan_digest,
            trace_id=trace_id,
            expected_root_version=expected_root_version,
            expected_step_version=expected_step_version,
        )

    async def _plan_digest(self, conn: AsyncConnection, org_id: str, plan_id: str) -> str:
        """A plan's digest, cached: a stored plan is immutable (digest-addressed), so
        the answer for ``(org, plan)`` never changes once found."""
        key = (org_id, plan_id)
        digest = self._plan_digests.get(key)
        if digest is None:
            digest = await plan_digest_txn(conn, org_id, plan_id)
            if len(self._plan_digests) >= _MAX_PLAN_DIGESTS:
                self._plan_digests.clear()
            self._plan_digests[key] = digest
        return digest

    async def continue_txn(
        self,
        conn: AsyncConnection,
        org_id: str,
        fence: LeaseFence,
        result: CommitResult,
        *,
        lease_owner: str,
        trace_id: str | None = None,
    ) -> LeaseFence | NotEligible:
        """Step continuation (``docs/adr/0002-step-continuation.md``): inside the
        transaction that just committed ``fence``'s step with ``result`` (root, step and
        attempt still locked by it), claim the run's new current step for ``lease_owner``
        through the ordinary claim decision (new attempt, new lease token) and move it
        ``Claimed -> Running`` — so the run's next step needs no discovery query, no
        claim transaction and no running transaction of its own.

        Returns the Running fence, or :class:`NotEligible` when the run has no new
        ``Runnable`` step or the claim decision refuses it (paused, not due …): nothing
        of the continuation is written then, and the step waits for an ordinary claim.

        Raises:
            FenceLostError: a conditional UPDATE of the continuation found its row moved
                (impossible while this transaction holds the root lock); the caller's
                transaction must roll back.
        """
        step_id = result.next_step_execution_id
        if step_id is None or result.run_state is not RunState.RUNNABLE:
            return NotEligible("no_next_step")
        now = result.committed_at if result.committed_at is not None else await self._clock(conn)
        held = None
        if result.root is not None and result.next_step is not None:
            held = (result.root, result.next_step)
        claimed = await self._claim_txn(
            conn,
            org_id,
            fence.flow_run_id,
            step_id,
            now=now,
            token=new_lease_token(),
            lease_owner=lease_owner,
            lock_plan_digest=EMPTY_LOCK_PLAN_DIGEST,
            trace_id=trace_id,
            expected_root_version=None,
            expected_step_version=None,
            held=held,
            running=True,
        )
        if isinstance(claimed, NotEligible):
            return claimed
        return claimed[0]

    async def claim_woken_txn(
        self,
        conn: AsyncConnection,
        org_id: str,
        root: RunRecord,
        step: StepRecord,
        now: datetime,
        *,
        lease_owner: str,
        trace_id: str | None = None,
        first: Sequence[Write] = (),
        last: Write | None = None,
    ) -> LeaseFence | NotEligible:
        """The pre-claimed wake (``docs/adr/0007-pre-claimed-wake.md``): inside the
        resolution transaction that locked ``root`` and ``step`` (root → step) and has
        just written them ``Runnable`` / ``Pending`` — ``root`` and ``step`` are those
        rows as it left them (derived in memory, ``kernel.applied``) — claim the woken
        step for ``lease_owner`` through the one claim decision and make it ``Running``
        in the claim's own writes (ADR 0003): ``decide_claim`` then
        ``decide_start_running``, new attempt row, new unpredictable lease token (its
        digest stored), lease deadline from ``now`` (the transaction's database clock),
        every version incremented. Only rows this transaction already holds are updated
        (the attempt is inserted).

        Returns the Running fence, or :class:`NotEligible` when the claim decision
        refuses (paused, deleted, not due, epoch, attempt budget spent …): nothing of the
        claim is written then, and the step stays ``Pending`` for an ordinary claim.

        ``first``: the resolution's own root/step and dependency UPDATEs, not executed
        yet (``root`` and ``step`` are the rows they leave: the claim's UPDATEs expect
        their versions), sent at the head of the claim's round trip; ``last``: the
        resolution's own last write (its signal UPDATE), sent as the last write of that
        round trip. Without a claim both go alone, in one round trip: each is always
        executed, exactly once (ADR 0010's addenda).

        Raises:
            FenceLostError: a conditional UPDATE found its row moved (unreachable while
                the caller holds the root and step locks, or a derivation that drifted);
                the caller's transaction must roll back.
        """
        if root.org_id != org_id or step.flow_run_id != root.flow_run_id:
            raise TransitionInputError("the woken step is not the run's", field="org_id")
        token = new_lease_token()
        request = await self._claim_request(
            conn,
            org_id,
            root.plan_id,
            token,
            lease_owner=lease_owner,
            lock_plan_digest=EMPTY_LOCK_PLAN_DIGEST,
            trace_id=trace_id,
            expected_root_version=root.state_version,
            expected_step_version=step.state_version,
        )
        decision = decide_claim(root, step, now, self.policy, request)
        if not isinstance(decision, Claimed):
            await execute_deferred(conn, first, last)
            if isinstance(decision, NotEligible):
                return decision
            # RetryExhausted: left to the ordinary claim, which records it.
            return NotEligible("attempt_budget_spent")
        fence, running_patch = _claimed_running(org_id, root, step, decision, request, token, now)
        await apply_claim_running(
            conn, org_id, decision.transition, running_patch, now, before=first, last=last
        )
        return fence

    async def mark_running(self, org_id: str, fence: LeaseFence) -> LeaseFence:
        """§12.2 step 3: step ``Claimed -> Running``; returns the fence with the new step
        version, which the final commit compares."""
        self._check_fence(org_id, fence)

        async def fn(conn: AsyncConnection) -> LeaseFence:
            return await _start_running_txn(conn, org_id, fence, await self._clock(conn))

        return await self._run(fn)

    async def extend_lease(self, org_id: str, fence: LeaseFence) -> LeaseFence:
        """§12.3 heartbeat (lifecycle-only, root then step): a new ``lease_until``; the
        commit fence (versions) is unchanged."""
        self._check_fence(org_id, fence)

        async def fn(conn: AsyncConnection) -> LeaseFence:
            # The lock read carries the clock (no statement of its own for it).
            root, step, attempt = await lock_fenced(conn, org_id, fence)
            now = await self._clock(conn)
            decision = decide_heartbeat(root, step, attempt, fence, now, self.policy)
            if isinstance(decision, FenceLost):
                raise fence_error(decision)
            await extend_lease_row(conn, org_id, step, fence.token_digest, decision.lease_until)
            return evolve(fence, lease_until=decision.lease_until)

        return await self._run(fn)

    # --- commit, rollback, ambiguity, recovery -------------------------------------------

    async def commit_step(
        self, org_id: str, fence: LeaseFence, *, output: CheckpointInput, advance: Advance
    ) -> CommitResult:
        """:meth:`commit_step_txn` in its own transaction (steps without business writes)."""
        self._check_fence(org_id, fence)
        prepared = prepare_checkpoint(output, max_bytes=self.max_checkpoint_bytes)
        return await self._run(
            lambda conn: self._commit(conn, org_id, fence, prepared, advance, None)
        )

    def lifecycle_lock(self, dialect: Dialect, org_id: str, fence: LeaseFence) -> Companion:
        """The locking read of ``fence``'s root, step and attempt (:meth:`commit_step_txn`'s
        first statement) as a companion read: a caller whose business lock is the last
        lock before the lifecycle's may send it in that lock's round trip
        (``services.db_batch.execute_reads``) and hand it to :meth:`commit_step_txn`."""
        self._check_fence(org_id, fence)
        return Companion(fenced_read(dialect, org_id, fence))

    async def commit_step_txn(
        self,
        conn: AsyncConnection,
        org_id: str,
        fence: LeaseFence,
        *,
        output: CheckpointInput,
        advance: Advance,
        evidence: Mapping[str, Any] | None = None,
        input_sequence: int | None = None,
        continue_as: ContinueAs | None = None,
        tail: CommitTail | None = None,
        business: Sequence[Write] = (),
        lifecycle: Companion | None = None,
        final: bool = False,
        before_commit: Callable[[], None] | None = None,
    ) -> CommitResult:
        """§12.2 steps 9-12, inside the worker's business transaction and after its
        business locks: lock root, step, attempt; revalidate the whole fence; insert the
        immutable output checkpoint; attempt ``Committed`` (with ``evidence`` — safe codes
        and digests such as the lock plan it committed with — as its metrics summary),
        step ``Succeeded`` (or ``Waiting``), root advanced with its pointers and
        compatibility projection.

        A ``NextStep`` advance with an empty ``step_execution_id`` gets a new id.

        ``input_sequence``: the sequence of the fence's input checkpoint, given when the
        caller knows it was the run's latest checkpoint at the fence's root version (a
        continued step: the transaction that wrote it also issued the fence, ADR 0002).
        Every checkpoint is inserted by run creation or by a commit that moves the root
        version, so while the locked root still has the fence's version no checkpoint
        came after it, and the next sequence is ``input_sequence + 1`` without a
        ``SELECT MAX``; on any other root version the sequence is read as always (the
        unique ``(org, run, sequence)`` key backs both).

        ``continue_as``: step continuation fused into the commit's writes (ADR 0003):
        when the commit advances the root to a new ``Runnable`` step and
        ``decide_claim`` / ``decide_start_running`` accept it on the rows the commit
        leaves, the root is written once (left ``Running`` on the new step), the new
        step is inserted claimed and ``Running`` and its attempt inserted;
        :attr:`CommitResult.continued` carries its fence. Otherwise the commit is
        written alone.

        ``tail``: the step's own new rows after the transition (:class:`CommitTail`),
        never with a continuation (a step with a tail waits).

        ``business``: the step's business writes, prepared under its business locks and
        not yet executed (``apply_intents_txn(defer=…)``, ADR 0011): they go out after the
        lifecycle locks and the fence's revalidation and first among the commit's writes
        — before the output checkpoint, in one round trip with them where the backend
        batches writes (§12.2 step 11). A fence lost at the lock read sends none of them.

        ``lifecycle``: :meth:`lifecycle_lock` of this fence, made by the caller; when its
        rows were read in this transaction (right after the step's business lock, in its
        round trip — ADR 0011's amendment) they are the lock read's rows; otherwise the
        lock read runs here.

        ``final``: the commit's writes are the caller's transaction's last (nothing runs
        on ``conn`` after this call): without a ``tail`` they carry its ``COMMIT`` where
        the backend allows, every fenced UPDATE's row count guarded on the server before
        it (``services.db_batch.commit_writes``, ADR 0014) — the caller's frame then
        sends no ``COMMIT``. ``before_commit``: called once, right before the
        ``COMMIT`` goes out (before the round trip that carries it; otherwise when this
        method's writes are done), never after a lost fence or a write that failed.

        Raises:
            FenceLostError: the fence no longer holds; the caller's transaction must roll
                back (every business write in it goes too).
            TransitionInputError: a malformed fence (before any SQL).
            InvalidArgumentError: the output checkpoint is too large or holds credentials
                (before any SQL of this method).
        """
        self._check_fence(org_id, fence)
        if tail is not None and continue_as is not None:
            raise InvariantError("a commit with a tail is never continued")
        prepared = prepare_checkpoint(output, max_bytes=self.max_checkpoint_bytes)
        return await self._commit(
            conn,
            org_id,
            fence,
            prepared,
            advance,
            evidence,
            input_sequence,
            continue_as,
            tail,
            business,
            lifecycle,
            final,
            before_commit,
        )

    async def _commit(
        self,
        conn: AsyncConnection,
        org_id: str,
        fence: LeaseFence,
        prepared: PreparedCheckpoint,
        advance: Advance,
        evidence: Mapping[str, Any] | None,
        input_sequence: int | None = None,
        continue_as: ContinueAs | None = None,
        tail: CommitTail | None = None,
        business: Sequence[Write] = (),
        lifecycle: Companion | None = None,
        final: bool = False,
        before_commit: Callable[[], None] | None = None,
    ) -> CommitResult:
        if isinstance(advance, NextStep) and not advance.step_execution_id:
            advance = evolve(advance, step_execution_id=new_id("step"))
        # The lock read carries the clock (no statement of its own for it).
        if lifecycle is not None and lifecycle.rows is not None:
            root, step, attempt = fenced_locked(conn, lifecycle.rows, fence)
        else:
            root, step, attempt = await lock_fenced(conn, org_id, fence)
        now = await self._clock(conn)
        checkpoint_id = new_id("ckpt")
        decision = decide_commit(root, step, attempt, fence, now, advance, checkpoint_id, evidence)
        if isinstance(decision, FenceLost):
            raise fence_error(decision)
        last_sequence = input_sequence if root.state_version == fence.root_state_version else None
        if last_sequence is None:
            last_sequence = await last_checkpoint_sequence(conn, org_id, root.flow_run_id)
        # The step's business writes (ADR 0011), then the checkpoint INSERT, go first
        # among the commit's writes — in one round trip with its UPDATEs and INSERTs
        # where the backend batches writes (ADR 0010).
        checkpoint, meta = checkpoint_insert(
            org_id,
            root.flow_run_id,
            prepared,
            checkpoint_id=checkpoint_id,
            created_by_attempt_id=attempt.attempt_id,
            now=now,
            last_sequence=last_sequence,
        )
        before = [*business, checkpoint]
        transition = decision.transition
        new_step = transition.new_step
        # The last writes carry the COMMIT (ADR 0014) unless a tail's rows follow them.
        carry = final and tail is None
        hook = before_commit if carry else None
        continued = None
        if continue_as is not None and decision.run_state is RunState.RUNNABLE:
            continued = await self._fused_continuation(
                conn, org_id, root, transition, now, continue_as, before, carry, hook
            )
        if continued is None:
            after = () if tail is None else await tail.writes(conn, now)
            inserted = await apply_transition(
                conn,
                org_id,
                transition,
                now,
                rows_locked=True,
                before=before,
                after=after,
                final=carry,
                before_commit=hook,
            )
            if tail is not None:
                await tail.settle(conn, inserted)
        if not carry and before_commit is not None:
            before_commit()
        checkpoint_written(prepared)
        # Continued: the root and next step were written as the continuation left them
        # (the fence carries what a caller needs); otherwise as the commit left them.
        written = continued is None
        return CommitResult(
            decision.run_state,
            meta,
            None if new_step is None else new_step.step_execution_id,
            committed_at=now,
            context_json=prepared.context_json,
            read_verification_json=prepared.read_verification_json,
            root=None
            if transition.run is None or not written
            else applied_run(root, transition.run, projected_step_state(transition), now),
            next_step=None
            if new_step is None or not written
            else inserted_step(org_id, new_step, now),
            continued=continued,
        )

    async def _fused_continuation(
        self,
        conn: AsyncConnection,
        org_id: str,
        root: RunRecord,
        commit: Transition,
        now: datetime,
        continue_as: ContinueAs,
        before: Sequence[Write] = (),
        final: bool = False,
        before_commit: Callable[[], None] | None = None,
    ) -> LeaseFence | None:
        """Decide the continuation of ``commit`` on the rows it leaves (derived in
        memory) and, if the claim and ``Running`` decisions accept, write ``before`` (the
        commit's checkpoint), the commit and the continuation together
        (``apply_commit_continued``); ``None`` writes nothing (the caller writes them)."""
        new_step = commit.new_step
        if commit.run is None or new_step is None or new_step.state is not StepState.PENDING:
            return None
        if continue_as.admit is not None and not continue_as.admit(new_step.queue_class):
            return None
        after_root = applied_run(root, commit.run, projected_step_state(commit), now)
        after_step = inserted_step(org_id, new_step, now)
        token = new_lease_token()
        request = await self._claim_request(
            conn,
            org_id,
            root.plan_id,
            token,
            lease_owner=continue_as.lease_owner,
            lock_plan_digest=EMPTY_LOCK_PLAN_DIGEST,
            trace_id=continue_as.trace_id,
            expected_root_version=None,
            expected_step_version=None,
        )
        decision = decide_claim(after_root, after_step, now, self.policy, request)
        if not isinstance(decision, Claimed):
            return None
        claim = decision.transition
        if claim.new_attempt is None:
            raise InvariantError("a claim adds an attempt")
        fence = decision.fence(org_id, root.flow_run_id, after_step, request, token)
        rows = _claimed_rows(org_id, after_root, after_step, claim, now)
        started = decide_start_running(*rows, fence, now)
        if isinstance(started, FenceLost) or started.transition.step is None:
            return None
        # One root UPDATE carries the commit and the claim: the root moves one version
        # (the claim decided on the commit's, one more), and the attempt records it.
        version = root.state_version + 1
        claim = evolve(
            claim,
            new_attempt=evolve(claim.new_attempt, root_state_version_at_claim=version),
        )
        await apply_commit_continued(
            conn,
            org_id,
            commit,
            claim,
            started.transition.step,
            now,
            before=before,
            final=final,
            before_commit=before_commit,
        )
        return evolve(fence, root_state_version=version, step_state_version=1)

    async def record_rollback(
        self, org_id: str, fence: LeaseFence, failure: StepFailure
    ) -> RetryScheduled | RetryExhausted | CancelWon:
        """§12.2 proven rollback (or classified pre-transaction failure), recorded in the
        small state transaction that follows it: retry with durable backoff, or fail."""
        self._check_fence(org_id, fence)

        async def fn(conn: AsyncConnection) -> RetryScheduled | RetryExhausted | CancelWon:
            # The lock read carries the clock (no statement of its own for it).
            root, step, attempt = await lock_fenced(conn, org_id, fence)
            now = await self._clock(conn)
            decision = decide_rollback_retry(root, step, attempt, fence, now, self.policy, failure)
            if isinstance(decision, FenceLost):
                raise fence_error(decision)
            if not isinstance(decision, CancelWon):
                await apply_transition(conn, org_id, decision.transition, now, rows_locked=True)
            return decision

        return await self._run(fn)

    async def quarantine_commit_unknown(
        self,
        org_id: str,
        fence: LeaseFence,
        outcome: AttemptOutcome = AttemptOutcome.COMMIT_UNKNOWN,
    ) -> Quarantined | AlreadyCommitted | CancelWon:
        """The connection died during COMMIT (or ROLLBACK): read the outcome marker; if
        the commit is not durable, quarantine attempt, step and root — never retry."""
        self._check_fence(org_id, fence)

        async def fn(conn: AsyncConnection) -> Quarantined | AlreadyCommitted | CancelWon:
            # The lock read carries the clock (no statement of its own for it).
            root, step, attempt = await lock_fenced(conn, org_id, fence)
            now = await self._clock(conn)
            decision = decide_commit_unknown(root, step, attempt, fence, now, outcome)
            if isinstance(decision, FenceLost):
                raise fence_error(decision)
            if isinstance(decision, Quarantined):
                await apply_transition(conn, org_id, decision.transition, now, rows_locked=True)
            return decision

        return await self._run(fn)

    async def recover_expired(self, org_id: str, *, limit: int = 100) -> list[RecoveryResult]:
        """§12.4 sweep: recover up to ``limit`` expired leases, one short transaction each."""

        async def scan(conn: AsyncConnection) -> list[tuple[str, str]]:
            now = await self._clock(conn)
            found = await expired_leases_txn(conn, org_id, now, limit)
            return [(e.flow_run_id, e.step_execution_id) for e in found]

        results = []
        for run_id, step_id in await self._read(scan):
            decision = await self.recover_step(org_id, run_id, step_id)
            results.append(RecoveryResult(run_id, step_id, decision))
        return results

    async def expired_leases(self, org_id: str, *, limit: int = 100) -> list[ExpiredLease]:
        """Leased steps of ``org_id`` past their deadline on the store's durable clock
        (a non-locking scan; :meth:`recover_step` decides each under lock)."""

        async def scan(conn: AsyncConnection) -> list[ExpiredLease]:
            return await expired_leases_txn(conn, org_id, await self._clock(conn), limit)

        return await self._read(scan)

    async def recover_step(
        self, org_id: str, flow_run_id: str, step_execution_id: str
    ) -> Recovered | RecoveryTerminal | NoChange:
        """§12.4 for one step: lock root, step, attempt; fence the expired attempt and
        install ``RetryScheduled`` with the backoff floor (or the terminal signal)."""

        async def fn(conn: AsyncConnection) -> Recovered | RecoveryTerminal | NoChange:
            now = await self._clock(conn)
            root = await lock_run(conn, org_id, flow_run_id)
            step = await lock_step(conn, org_id, step_execution_id)
            if root is None or step is None or step.flow_run_id != root.flow_run_id:
                return NoChange("missing")
            attempt = await lock_latest_attempt(conn, org_id, step)
            prior = await count_fenced_attempts(conn, org_id, step_execution_id)
            decision = decide_recovery(root, step, attempt, now, self.policy, prior)
            if not isinstance(decision, NoChange):
                await apply_transition(conn, org_id, decision.transition, now, rows_locked=True)
            return decision

        return await self._run(fn)

    # --- cancellation and delete ---------------------------------------------------------

    async def request_cancel(
        self, org_id: str, flow_run_id: str, *, expected_state_version: int | None = None
    ) -> CancelRecorded | Tombstoned | NoChange:
        """Cancel a run (§11.1): root ``CancelRequested``, active step/attempt fenced."""
        return await self._run(
            lambda conn: self.cancel_txn(
                conn,
                org_id,
                flow_run_id,
                delete=False,
                expected_state_version=expected_state_version,
            )
        )

    async def delete_run(
        self, org_id: str, flow_run_id: str, *, expected_state_version: int | None = None
    ) -> CancelRecorded | Tombstoned | NoChange:
        """§10.1 ``DeleteFlowInterview`` steps 2-5 (the caller authorized step 1):
        soft delete through ``IsDeleted`` plus fenced cancellation; idempotent."""
        return await self._run(
            lambda conn: self.cancel_txn(
                conn,
                org_id,
                flow_run_id,
                delete=True,
                expected_state_version=expected_state_version,
            )
        )

    async def cancel_txn(
        self,
        conn: AsyncConnection,
        org_id: str,
        flow_run_id: str,
        *,
        delete: bool,
        expected_state_version: int | None = None,
    ) -> CancelRecorded | Tombstoned | NoChange:
        """:meth:`request_cancel` (``delete=False``) or :meth:`delete_run` inside the
        caller's transaction.

        ``expected_state_version`` (``None``: no expectation) is the root version the
        transition's compare-and-swap must find: the decision is made on the locked root
        *at that version* and its conditional UPDATE carries it, so a root that moved —
        before the lock or, on TiDB, after a lost pessimistic lock — refuses the
        transition. A delete of a run that is already deleted answers its outcome
        whatever the version (a repeat is idempotent).

        Raises:
            NotFoundError: missing or foreign run (or deleted, for a plain cancel).
            StateVersionMismatchError: the root is not at ``expected_state_version``.
        """
        now = await self._clock(conn)
        root, step = await lock_root_and_current(conn, org_id, flow_run_id)
        if root.is_deleted and not delete:
            raise NotFoundError("flow_run", flow_run_id)
        expected = expected_state_version
        idempotent_delete = delete and root.is_deleted
        if expected is not None and not idempotent_delete and root.state_version != expected:
            raise StateVersionMismatchError(expected, root.state_version)
        attempt = None if step is None else await lock_latest_attempt(conn, org_id, step)
        decision = decide_cancel(root, step, attempt, now, delete=delete)
        if not isinstance(decision, NoChange):
            try:
                await apply_transition(conn, org_id, decision.transition, now, rows_locked=True)
            except FenceLostError as exc:
                if expected is None:
                    raise
                raise StateVersionMismatchError(expected, exc.found_version) from exc
            if isinstance(decision, CancelRecorded) and step is not None:
                # §11.1/§14.3: a waiting step's dependency is cancelled in the same
                # root-first transaction (root → step → attempt → dependency).
                await cancel_step_dependencies_txn(conn, org_id, step, now)
        return decision

    async def pending_cancellations(self, org_id: str, *, limit: int = 100) -> list[str]:
        """Ids of ``CancelRequested`` runs (deleted ones included) for the cleanup sweep."""
        return await self._read(lambda conn: cancel_requested_runs_txn(conn, org_id, limit))

    async def complete_cancel(self, org_id: str, flow_run_id: str) -> CancelCompleted | NoChange:
        """Cancellation cleanup: ``CancelRequested -> Cancelled`` (idempotent).

        A current step with a *pending* effect handoff is not cleaned up here
        (``NoChange("handoff_pending")``): §10.1 cancels a pending handoff only after the
        owner's durable ``Rejected`` receipt, and an accepted one keeps tracking the
        owner outcome — ``runtime_svc.effects`` completes those cancellations. A step
        whose effect already completed ends with ``cancelled_after_effect``: the
        cancellation never claims the effect was rolled back.
        """

        async def fn(conn: AsyncConnection) -> CancelCompleted | NoChange:
            now = await self._clock(conn)
            root, step = await lock_root_and_current(conn, org_id, flow_run_id)
            attempt = None if step is None else await lock_latest_attempt(conn, org_id, step)
            cause = None
            if step is not None and root.state is RunState.CANCEL_REQUESTED:
                effect = await effect_dependency_of_step_txn(conn, org_id, step)
                if effect is not None and effect.state is DependencyState.PENDING:
                    return NoChange("handoff_pending")
                if effect is not None and _effect_succeeded(effect):
                    cause = CAUSE_CANCELLED_AFTER_EFFECT
            decision = decide_cancel_cleanup(root, step, attempt, now, cause=cause)
            if isinstance(decision, CancelCompleted):
                await apply_transition(conn, org_id, decision.transition, now, rows_locked=True)
            return decision

        return await self._run(fn)

    # --- waits (called by the dependency engine inside its own transaction) --------------

    async def resolve_wait_txn(
        self, conn: AsyncConnection, org_id: str, flow_run_id: str
    ) -> WaitResolved | NoChange:
        """Step ``Waiting -> Pending`` with root ``Waiting -> Runnable`` (§14, §18.2)."""
        now = await self._clock(conn)
        root, step = await lock_root_and_current(conn, org_id, flow_run_id)
        if step is None:
            return NoChange("no_current_step")
        decision = decide_resolve_wait(root, step, now)
        if isinstance(decision, WaitResolved):
            await apply_transition(conn, org_id, decision.transition, now, rows_locked=True)
        return decision

    async def expire_wait_txn(
        self, conn: AsyncConnection, org_id: str, flow_run_id: str, *, quarantine: bool
    ) -> WaitExpired | NoChange:
        """Dependency expiry under a terminal or quarantine policy (§14.3)."""
        now = await self._clock(conn)
        root, step = await lock_root_and_current(conn, org_id, flow_run_id)
        if step is None:
            return NoChange("no_current_step")
        decision = decide_wait_expired(root, step, now, quarantine=quarantine)
        if isinstance(decision, WaitExpired):
            await apply_transition(conn, org_id, decision.transition, now, rows_locked=True)
        return decision

    # --- reads ---------------------------------------------------------------------------

    async def get_run(
        self, org_id: str, flow_run_id: str, *, include_deleted: bool = False
    ) -> RunRecord:
        """The run in the trusted org (``NotFoundError`` when missing, foreign or deleted)."""
        return await self._read(
            lambda conn: get_run_txn(conn, org_id, flow_run_id, include_deleted=include_deleted)
        )

    async def list_runs(
        self,
        org_id: str,
        filters: RunFilters | None = None,
        page_size: int = DEFAULT_PAGE_SIZE,
        page_token: str = "",
    ) -> RunPage:
        """Org-scoped, non-deleted runs, stable ``(created_at, run id)`` keyset pages."""
        return await self._read(
            lambda conn: list_runs_page_txn(
                conn, org_id, filters or RunFilters(), page_size, page_token
            )
        )

    async def support_view(
        self, org_id: str, flow_run_id: str, *, include_deleted: bool = False
    ) -> SupportView:
        """§19 support read (no checkpoint payload)."""
        return await self._read(
            lambda conn: support_view_txn(
                conn, org_id, flow_run_id, include_deleted=include_deleted
            )
        )

    async def get_checkpoint(self, org_id: str, flow_run_id: str, checkpoint_id: str) -> Checkpoint:
        """A checkpoint with its payload (the worker's step input)."""
        return await self._read(
            lambda conn: get_checkpoint_txn(conn, org_id, flow_run_id, checkpoint_id)
        )

    async def candidate_for_run(self, org_id: str, flow_run_id: str) -> Candidate | None:
        """The run's current step when it is due now (a synchronous executor claims its
        own run through the same §12.1 claim as the workers), else ``None``."""

        async def fn(conn: AsyncConnection) -> Candidate | None:
            now = await self._clock(conn)
            return await candidate_for_run_txn(conn, org_id, flow_run_id, now, self.ownership_epoch)

        return await self._read(fn)

    async def eligible_work(
        self, org_id: str, queue_class: str, *, limit: int = 50
    ) -> list[Candidate]:
        """§12.1 step 1: a bounded, stably ordered batch of due candidates."""

        async def fn(conn: AsyncConnection) -> list[Candidate]:
            # The database's own clock is read by the query itself where it can (one round
            # trip, which also carries the COMMIT: ADR 0013); another clock is read first.
            now = None if self._clock is db_now else await self._clock(conn)
            return await eligible_work_txn(
                conn, org_id, queue_class, now, limit, self.ownership_epoch, last=True
            )

        return await self._read(fn)


async def _start_running_txn(
    conn: AsyncConnection, org_id: str, fence: LeaseFence, now: datetime
) -> LeaseFence:
    """§12.2 step 3 inside ``conn``: lock root, step and attempt under ``fence`` and move
    the step ``Claimed -> Running``; the fence comes back with the new step version, which
    the final commit compares (:meth:`FlowRunStateStore.mark_running`)."""
    rows = await lock_fenced(conn, org_id, fence)
    return await _start_running_rows(conn, org_id, fence, rows, now)


def _claimed_running(
    org_id: str,
    root: RunRecord,
    step: StepRecord,
    decision: Claimed,
    request: ClaimRequest,
    token: str,
    now: datetime,
) -> tuple[LeaseFence, StepPatch]:
    """The fused claim's second decision (ADR 0003): ``decide_start_running`` on the
    rows the claim ``decision`` leaves (derived in memory, ``kernel.applied``) — the
    same decision as the running transaction, on the same rows. Returns the claim's
    fence and the ``Running`` step patch to write with the claim's.

    Raises:
        FenceLostError: unreachable — the claim just decided these rows.
        InvariantError: ``decide_start_running`` did not patch the step.
    """
    fence = decision.fence(org_id, root.flow_run_id, step, request, token)
    rows = _claimed_rows(org_id, root, step, decision.transition, now)
    started = decide_start_running(*rows, fence, now)
    if isinstance(started, FenceLost):
        raise fence_error(started)
    if started.transition.step is None:
        raise InvariantError("decide_start_running patches the step")
    return fence, started.transition.step


def _claimed_rows(
    org_id: str, root: RunRecord, step: StepRecord, transition: Transition, now: datetime
) -> tuple[RunRecord, StepRecord, AttemptRecord]:
    """Root, step and attempt as a claim's ``transition`` left them (in memory).

    Raises:
        InvariantError: the transition is not a claim's (root, step and new attempt).
    """
    if transition.run is None or transition.step is None or transition.new_attempt is None:
        raise InvariantError("a claim transition patches root and step and adds an attempt")
    projected = projected_step_state(transition)
    return (
        applied_run(root, transition.run, projected, now),
        applied_step(step, transition.step, now),
        inserted_attempt(org_id, transition.new_attempt),
    )


async def _start_running_rows(
    conn: AsyncConnection,
    org_id: str,
    fence: LeaseFence,
    rows: tuple[RunRecord, StepRecord, AttemptRecord],
    now: datetime,
) -> LeaseFence:
    """:func:`_start_running_txn` on rows this transaction already holds: the running
    transaction's, or the continuation's claim in the committing transaction."""
    root, step, attempt = rows
    decision = decide_start_running(root, step, attempt, fence, now)
    if isinstance(decision, FenceLost):
        raise fence_error(decision)
    await apply_transition(conn, org_id, decision.transition, now, rows_locked=True)
    return evolve(fence, step_state_version=decision.step_state_version)
