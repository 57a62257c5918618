"""``RunService``: the Flow-run lifecycle behind ``FlowRunService`` (§10.1, §18, §19).

Every method takes the trusted org or work scope first (from the verified credential,
never from a body); a run of another org answers exactly like a missing one. Writes go
through :class:`~runtime_svc.kernel.FlowRunStateStore` only; this layer resolves plans,
validates inputs, authorizes, and projects what the API returns.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar

from sqlalchemy import bindparam, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.atomic import AtomicRunner
from runtime_svc.compiler.kinds import ExecutionProfile
from runtime_svc.compiler.plan import ExecutionPlan
from runtime_svc.definitions import repository as repo
from runtime_svc.effects.support import EffectSupport, effect_support_txn
from runtime_svc.identity import RunIdentity, record_initiator_txn, run_identities_txn
from runtime_svc.kernel import (
    CheckpointInput,
    ClaimedStart,
    FlowRunStateStore,
    RunRecord,
    RunState,
    StartRunRequest,
    StartRunResult,
    SupportView,
)
from runtime_svc.kernel.states import TERMINAL_RUN_STATES, ExecutionOwner
from runtime_svc.kernel.store_reads import (
    RunCursor,
    RunFilters,
    get_checkpoint_txn,
    get_run_txn,
    list_runs_txn,
)
from runtime_svc.legacy.service import LegacyInterviewService
from runtime_svc.migration.cohorts import choose_owner_txn
from runtime_svc.migration.protocol import V2AdmissionClosedError
from runtime_svc.runs.inputs import validate_input_variables
from runtime_svc.runs.keys import start_key
from runtime_svc.runs.resolve import (
    FlowTarget,
    ResolvedPlan,
    first_step_of,
    plan_of_run_txn,
    resolve_plan_by_id_txn,
    resolve_plan_txn,
)
from runtime_svc.runs.tokens import PageCursor, PageTokenCodec
from runtime_svc.schema import execution_plans, runtime_requests
from runtime_svc.waits.support import DependencySupport, dependency_support_txn
from services.auth import CANCEL_ROLE, DELETE_ROLE, TrustedIdentity, TrustedRuntimeWorkScope
from services.db import db_now, run_in_transaction, transaction
from services.digest import versioned_digest
from services.errors import (
    AlreadyExistsError,
    ConflictError,
    FailedPreconditionError,
    FenceLostError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
)
from services.request_dedupe import RequestKey, RequestLedger

__all__ = [
    "CANCEL_ROLE",
    "DELETE_ROLE",
    "IdempotencyKeyReusedError",
    "RunService",
    "RunSupport",
    "RunView",
    "StartOutcome",
    "StartResponder",
]

T = TypeVar("T")

#: ``ListRuns`` page sizes: the default and the clamp.
DEFAULT_LIST_PAGE_SIZE, MAX_LIST_PAGE_SIZE = 50, 500
#: The plan digests of a page of runs (one IN list of the page's plan ids), built once.
_PLAN_DIGESTS = select(execution_plans.c.plan_id, execution_plans.c.plan_digest).where(
    execution_plans.c.org_id == bindparam("org"),
    execution_plans.c.plan_id.in_(bindparam("plans", expanding=True)),
)
# DELETE_ROLE: a credential needs it for the public delete (§10.1 step 1); CANCEL_ROLE: to
# cancel a run. Defined with the trusted-key constraints (services.auth.trust), which name
# the roles a key may sign.


@dataclass(frozen=True)
class RunView:
    """A run with what its public view derives from other rows."""

    run: RunRecord
    flow_api_name: str
    plan_digest: str
    output_variables: Mapping[str, Any] | None = None
    #: The §17.1 identity the run stored (``None``: not recorded).
    identity: RunIdentity | None = None


@dataclass(frozen=True)
class StartOutcome:
    """``StartRun``'s answer: the run, whether it finished within the wait budget, and
    whether the idempotency key matched an existing run."""

    view: RunView
    completed: bool
    existing_run: bool


@dataclass(frozen=True)
class RunSupport:
    """§19 support read: the kernel's view plus the immutable plan."""

    view: RunView
    support: SupportView
    plan_row: repo.PlanRow
    plan: ExecutionPlan
    subflow_version_ids: Mapping[tuple[str, int], str] = field(default_factory=dict)
    #: Dependency correlation (§19): producer, age, probes, the consumed signal.
    dependencies: tuple[DependencySupport, ...] = ()
    #: Effect correlation (§19): each immutable link with its message's delivery state.
    effects: tuple[EffectSupport, ...] = ()


class StartResponder(Protocol):
    """How the API layer serializes a ``StartRun`` answer for the request ledger (and
    reads back the run a provisional answer accepted)."""

    def encode(self, outcome: StartOutcome) -> bytes:
        """The response bytes of ``outcome``."""
        ...

    def accepted(self, response: bytes) -> tuple[str, bool]:
        """``(flow_run_id, existing_run)`` of a recorded response."""
        ...


class IdempotencyKeyReusedError(AlreadyExistsError):
    """``StartRun``'s ``idempotency_key`` already names a run of a different request."""

    reason = "idempotency_key_reused"

    def __init__(self) -> None:
        super().__init__("flow_run", "idempotency_key")
        self.field_path = "idempotency_key"
        self.safe_message = (
            "idempotency_key was already used for a different StartRun request (target, "
            "input variables or scope differ); a retry must repeat the request unchanged, "
            "a new request needs a new key"
        )
        self.args = (self.safe_message,)


def _require_role(identity: TrustedIdentity, role: str, action: str) -> None:
    if role not in identity.roles:
        raise PermissionDeniedError(
            f"the workload credential may not {action} Flow runs (role {role} missing)",
            reason="role_missing",
        )


@dataclass(frozen=True)
class _Prepared:
    """A start request after resolution and validation: the V2 request, the inputs and
    whether the run's cohort gives it to the LegacyInterpreter (§20)."""

    resolved: ResolvedPlan
    request: StartRunRequest
    inputs: Mapping[str, Any]
    legacy: bool


class RunService:
    """Start, read, list, delete and cancel Flow runs of one database.

    Args:
        engine: the runtime database.
        store: the run state store (the only write path).
        page_tokens: the ``ListRuns`` token codec (one secret across replicas).
        max_wait_s: the API budget ``wait_budget`` is clamped to (§18.3).
        poll_interval_s: pause between state reads while waiting.
        atomic: executes Bounded Atomic runs synchronously (``None``: the workers do).
        atomic_budget_s: how long ``StartRun`` of a Bounded Atomic Flow executes it
            synchronously when the request asks for a shorter (or no) wait; clamped to
            ``max_wait_s``.
        ledger: the request-dedupe ledger of the mutating RPCs (``runtime_requests``).
        legacy: the LegacyInterpreter owner (§20): new runs whose cohort selects it are
            admitted there, and reads/deletes/cancels of its runs are routed to it;
            ``None`` admits V2 only (a legacy-owned choice then fails closed).

    Methods named ``*_once`` take the request's :class:`~services.request_dedupe.RequestKey`
    and an encoder and return the response bytes: the mutation and its ledger row commit
    in one transaction, a retry replays the original bytes (``services.request_dedupe``).
    """

    def __init__(
        self,
        engine: AsyncEngine,
        store: FlowRunStateStore,
        page_tokens: PageTokenCodec,
        *,
        max_wait_s: float = 30.0,
        poll_interval_s: float = 0.05,
        atomic: AtomicRunner | None = None,
        atomic_budget_s: float = 5.0,
        ledger: RequestLedger | None = None,
        legacy: LegacyInterviewService | None = None,
    ) -> None:
        self._engine = engine
        self._ledger = ledger or RequestLedger(runtime_requests)
        self.store = store
        self._tokens = page_tokens
        self._max_wait_s = max_wait_s
        self._poll_s = poll_interval_s
        self._atomic = atomic
        self._atomic_budget_s = atomic_budget_s
        self._legacy = legacy

    # --- start -------------------------------------------------------------------------

    async def start_run(
        self,
        scope: TrustedRuntimeWorkScope,
        target: FlowTarget | str,
        input_variables: Mapping[str, Any],
        *,
        idempotency_key: str = "",
        wait_budget_s: float = 0.0,
    ) -> StartOutcome:
        """Accept an autolaunched run on the active plan of ``target`` (§18.3).

        Raises:
            NotFoundError: no such Flow/plan active in ``scope``.
            FailedPreconditionError: version/plan not active, or not autolaunched.
            InvalidArgumentError: bad input variables or credential material in them
                (nothing is written).
            AlreadyExistsError: ``idempotency_key`` was used for a different request.
        """
        p = await self._prepare(scope, target, input_variables, idempotency_key)
        if p.legacy:
            return await self._start_legacy(scope, p)
        try:
            result = await self._create(scope, p.request, p.resolved.plan)
        except V2AdmissionClosedError:
            # Admission closed between the owner choice and the insert (§20.9): the new
            # run returns to the legacy cohort; nothing V2 was written.
            if self._legacy is None:
                raise
            return await self._start_legacy(scope, p)
        return await self._drive(
            scope, p.resolved, result.run, not result.created, wait_budget_s, result.claimed
        )

    async def start_run_once(
        self,
        scope: TrustedRuntimeWorkScope,
        key: RequestKey,
        responder: StartResponder,
        target: FlowTarget | str,
        input_variables: Mapping[str, Any],
        *,
        idempotency_key: str = "",
        wait_budget_s: float = 0.0,
    ) -> bytes:
        """:meth:`start_run` deduplicated on ``key``: the run is accepted in the same
        transaction as a *provisional* ledger answer (the accepted run), so one
        ``request_id`` never starts two runs, with or without an idempotency key; the
        answer after the synchronous execution or wait completes it. A retry replays the
        completed answer, or — when the first call has not completed it (still running,
        or its process died) — drives the accepted run again within its own budget.

        Raises:
            RequestIdReusedError: ``request_id`` was used with another body.
            The errors of :meth:`start_run`.
        """
        stored = await self._ledger.replay(self._engine, key)
        if stored is not None and stored.payload is not None:
            if stored.completed:
                return stored.payload
            return await self._resume(scope, key, responder, stored.payload, wait_budget_s)
        p = await self._prepare(scope, target, input_variables, idempotency_key)
        resolved = p.resolved
        if p.legacy:
            return await self._ledger.once(
                self._engine, key, lambda: self._start_legacy(scope, p), responder.encode
            )

        async def create(conn: AsyncConnection) -> StartRunResult:
            return await self._create_txn(conn, scope, p.request, resolved.plan)

        def provisional(result: StartRunResult) -> bytes:
            view = RunView(result.run, resolved.flow_api_name, resolved.row.plan_digest)
            terminal = result.run.state in TERMINAL_RUN_STATES
            return responder.encode(StartOutcome(view, terminal, not result.created))

        try:
            done = await self._ledger.execute(
                self._engine, key, create, provisional, completed=False
            )
        except V2AdmissionClosedError:
            # As in start_run: nothing V2 (and no ledger row) was written.
            if self._legacy is None:
                raise
            return await self._ledger.once(
                self._engine, key, lambda: self._start_legacy(scope, p), responder.encode
            )
        if done.replayed and done.response is not None:
            if done.completed:
                return done.response
            return await self._resume(scope, key, responder, done.response, wait_budget_s)
        if done.value is None:  # pragma: no cover - a fresh execution always has a value
            raise FailedPreconditionError("the run was not accepted", reason="internal")
        result = done.value
        outcome = await self._drive(
            scope, resolved, result.run, not result.created, wait_budget_s, result.claimed
        )
        return await self._ledger.complete(self._engine, key, responder.encode(outcome))

    async def _prepare(
        self,
        scope: TrustedRuntimeWorkScope,
        target: FlowTarget | str,
        input_variables: Mapping[str, Any],
        idempotency_key: str,
    ) -> _Prepared:
        """Resolve the plan, validate the inputs, build the V2 request and choose the
        owner (nothing written)."""
        async with transaction(self._engine, readonly=True) as conn:
            if isinstance(target, FlowTarget):
                resolved = await resolve_plan_txn(conn, scope, target)
            else:
                resolved = await resolve_plan_by_id_txn(conn, scope, target)
        inputs = validate_input_variables(
            resolved.variables, input_variables, max_bytes=self.store.max_checkpoint_bytes
        )
        first = first_step_of(resolved.plan, resolved.row.execution_profile)
        request = StartRunRequest(
            plan_id=resolved.row.plan_id,
            first_step=first,
            input=CheckpointInput(
                context={"variables": inputs},
                plan_cursor={"step": first.plan_step_key},
            ),
            idempotency_key=(
                start_key(scope, resolved.flow_api_name, idempotency_key)
                if idempotency_key
                else None
            ),
        )
        legacy = self._legacy is not None and await self._legacy_owned_start(
            scope, resolved, request.idempotency_key
        )
        return _Prepared(resolved, request, inputs, legacy)

    async def _resume(
        self,
        scope: TrustedRuntimeWorkScope,
        key: RequestKey,
        responder: StartResponder,
        provisional: bytes,
        wait_budget_s: float,
    ) -> bytes:
        """Drive the run a provisional answer accepted, then complete the answer."""
        run_id, existing = responder.accepted(provisional)

        async def read(conn: AsyncConnection) -> tuple[RunRecord, ResolvedPlan]:
            run = await get_run_txn(conn, scope.org_id, run_id, include_deleted=True)
            return run, await plan_of_run_txn(conn, scope, run)

        async with transaction(self._engine, readonly=True) as conn:
            run, resolved = await read(conn)
        outcome = await self._drive(scope, resolved, run, existing, wait_budget_s)
        return await self._ledger.complete(self._engine, key, responder.encode(outcome))

    async def _drive(
        self,
        scope: TrustedRuntimeWorkScope,
        resolved: ResolvedPlan,
        run: RunRecord,
        existing: bool,
        wait_budget_s: float,
        claimed: ClaimedStart | None = None,
    ) -> StartOutcome:
        """Execute a Bounded Atomic run synchronously, or wait for the run, within the
        budget (§18.3); the run's answer either way. ``claimed``: the creating
        transaction already claimed the run's step for the atomic runner (ADR 0005)."""
        completed = run.state in TERMINAL_RUN_STATES
        if (
            not completed
            and self._atomic is not None
            and resolved.row.execution_profile == (ExecutionProfile.BOUNDED_ATOMIC.value)
        ):
            # §18.3: the one logical mutation step runs now; the terminal result returns
            # when it completes within the API budget, the run identity otherwise.
            budget = min(max(wait_budget_s, self._atomic_budget_s), self._max_wait_s)
            if claimed is not None:
                run = await self._atomic.run_claimed(run, claimed, budget)
            else:
                run = await self._atomic.run(scope.org_id, run.flow_run_id, budget)
            completed = run.state in TERMINAL_RUN_STATES
        if not completed and wait_budget_s > 0:
            run = await self._wait(scope.org_id, run, min(wait_budget_s, self._max_wait_s))
            completed = run.state in TERMINAL_RUN_STATES
        async with transaction(self._engine, readonly=True) as conn:
            outputs = await self._outputs_txn(conn, run, resolved.plan)
            identity = await run_identities_txn(conn, scope.org_id, [run.flow_run_id])
        view = RunView(
            run,
            resolved.flow_api_name,
            resolved.row.plan_digest,
            outputs,
            identity.get(run.flow_run_id),
        )
        return StartOutcome(view, completed=completed, existing_run=existing)

    async def _legacy_owned_start(
        self, scope: TrustedRuntimeWorkScope, resolved: ResolvedPlan, key: str | None
    ) -> bool:
        """Whether this start belongs to the LegacyInterpreter: a replayed key keeps the
        owner of the run it names; a new run gets its cohort's owner (§20.6-§20.8)."""
        async with transaction(self._engine, readonly=True) as conn:
            if key is not None:
                existing = await self.store.run_by_key_txn(conn, scope.org_id, key)
                if existing is not None:
                    return existing.execution_owner is ExecutionOwner.LEGACY_INTERPRETER
            choice = await choose_owner_txn(
                conn, scope.org_id, resolved.row.flow_version_id, resolved.row.execution_profile
            )
        return choice.owner is ExecutionOwner.LEGACY_INTERPRETER

    async def _start_legacy(self, scope: TrustedRuntimeWorkScope, p: _Prepared) -> StartOutcome:
        """``CreateInterview`` on the legacy owner; its first segment runs now."""
        legacy = self._require_legacy()
        key = p.request.idempotency_key
        digest = versioned_digest(
            "legacy-start-request",
            {
                "scope": [scope.org_id, scope.app_installation_id, scope.runtime_capability_id,
                          scope.runtime_work_binding_digest],
                "flow_version_id": p.resolved.row.flow_version_id,
                "input": dict(p.inputs),
            },
        )  # fmt: skip
        try:
            interview, created = await legacy.start(
                scope,
                p.resolved.row.flow_version_id,
                p.inputs,
                idempotency_key=key,
                request_digest=digest,
            )
        except ConflictError as exc:
            if isinstance(exc, FenceLostError) or key is None:
                raise
            raise IdempotencyKeyReusedError() from exc
        run = await self.store.get_run(scope.org_id, interview.flow_run_id, include_deleted=True)
        view = RunView(run, p.resolved.flow_api_name, "", interview.outputs())
        return StartOutcome(view, completed=interview.terminal, existing_run=not created)

    async def _create_txn(
        self,
        conn: AsyncConnection,
        scope: TrustedRuntimeWorkScope,
        request: StartRunRequest,
        plan: ExecutionPlan,
    ) -> StartRunResult:
        try:
            if self._atomic is not None and plan.profile is ExecutionProfile.BOUNDED_ATOMIC:
                # ADR 0005: the run is created already claimed and Running for the
                # synchronous runner, which executes it right after this commit.
                result = await self.store.create_run_claimed_txn(
                    conn, scope, request, lease_owner=self._atomic.owner
                )
            else:
                result = await self.store.create_run_txn(conn, scope, request)
        except ConflictError as exc:
            if isinstance(exc, FenceLostError) or request.idempotency_key is None:
                raise
            raise IdempotencyKeyReusedError() from exc
        # §17.1: the run stores who initiated it, in the transaction that creates it.
        await record_initiator_txn(conn, scope.org_id, result, plan)
        return result

    async def _create(
        self, scope: TrustedRuntimeWorkScope, request: StartRunRequest, plan: ExecutionPlan
    ) -> StartRunResult:
        # The store reads a lost insert race back and compares request digests, so a
        # concurrent duplicate is a replay and only a different body is a conflict.
        return await run_in_transaction(
            self._engine, lambda conn: self._create_txn(conn, scope, request, plan)
        )

    async def _wait(self, org_id: str, run: RunRecord, budget_s: float) -> RunRecord:
        # Bounded: one read per interval until terminal or the budget is spent.
        deadline = time.monotonic() + budget_s
        while run.state not in TERMINAL_RUN_STATES:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            await asyncio.sleep(min(self._poll_s, remaining))
            run = await self.store.get_run(org_id, run.flow_run_id, include_deleted=True)
        return run

    @staticmethod
    async def _outputs_txn(
        conn: AsyncConnection, run: RunRecord, plan: ExecutionPlan
    ) -> Mapping[str, Any] | None:
        if run.state is not RunState.SUCCEEDED or run.current_checkpoint_id is None:
            return None
        checkpoint = await get_checkpoint_txn(
            conn, run.org_id, run.flow_run_id, run.current_checkpoint_id
        )
        context = json.loads(checkpoint.context_json)
        values = context.get("variables", {}) if isinstance(context, dict) else {}
        declared = {v.name for v in plan.variables if v.output}
        return {k: v for k, v in values.items() if k in declared}

    # --- reads -------------------------------------------------------------------------

    async def _views(self, conn: AsyncConnection, runs: Iterable[RunRecord]) -> list[RunView]:
        runs = list(runs)
        if not runs:
            return []
        org = runs[0].org_id
        versions = await repo.get_flow_versions_txn(conn, org, [r.flow_version_id for r in runs])
        params = {"org": org, "plans": sorted({r.plan_id for r in runs})}
        digests = {
            row.plan_id: row.plan_digest for row in await conn.execute(_PLAN_DIGESTS, params)
        }
        identities = await run_identities_txn(conn, org, [r.flow_run_id for r in runs])
        out = []
        for r in runs:
            version = versions.get(r.flow_version_id)
            out.append(
                RunView(
                    r,
                    "" if version is None else version.flow_api_name,
                    str(digests.get(r.plan_id, "")),
                    identity=identities.get(r.flow_run_id),
                )
            )
        return out

    async def _view_txn(self, conn: AsyncConnection, run: RunRecord) -> RunView:
        """The run's public view (outputs of a succeeded run included), in ``conn``."""
        (view,) = await self._views(conn, [run])
        if run.state is not RunState.SUCCEEDED:
            return view
        if run.execution_owner is ExecutionOwner.LEGACY_INTERPRETER:
            if self._legacy is None:
                return view
            interview = await self._legacy.store.get_txn(
                conn, run.org_id, run.flow_run_id, include_deleted=True
            )
            return replace(view, plan_digest="", output_variables=interview.outputs())
        row = await repo.get_plan_txn(conn, run.org_id, run.plan_id)
        if row is None:
            return view
        return replace(view, output_variables=await self._outputs_txn(conn, run, row.plan()))

    async def get_run(
        self, org_id: str, flow_run_id: str, *, include_deleted: bool = False
    ) -> RunView:
        """The run ``(org_id, flow_run_id)``; ``NotFoundError`` when missing, foreign or
        soft-deleted (§10.1 step 6)."""
        async with transaction(self._engine, readonly=True) as conn:
            run = await get_run_txn(conn, org_id, flow_run_id, include_deleted=include_deleted)
            return await self._view_txn(conn, run)

    async def list_runs(
        self, org_id: str, filters: RunFilters, page_size: int = 0, page_token: str = ""
    ) -> tuple[list[RunView], str]:
        """One page of the org's visible runs (the kernel's ``list_runs_txn``, in
        ``(created_at, run id)`` order) and the next signed token (``""`` at the end).

        Raises:
            InvalidArgumentError: negative ``page_size``; malformed/foreign ``page_token``.
        """
        if page_size < 0:
            raise InvalidArgumentError("page_size must not be negative", field_path="page_size")
        size = min(page_size or DEFAULT_LIST_PAGE_SIZE, MAX_LIST_PAGE_SIZE)
        digest = filters.digest()
        cursor = self._tokens.decode(org_id, digest, page_token)
        after = None if cursor is None else RunCursor(cursor.created_at, cursor.flow_run_id)
        async with transaction(self._engine, readonly=True) as conn:
            runs, more = await list_runs_txn(conn, org_id, filters, limit=size, after=after)
            views = await self._views(conn, runs)
        token = ""
        if more and runs:
            last = runs[-1]
            token = self._tokens.encode(
                org_id, digest, PageCursor(last.created_at, last.flow_run_id)
            )
        return views, token

    async def support(self, org_id: str, flow_run_id: str) -> RunSupport:
        """§19 support read of ``(org_id, flow_run_id)`` — never by run id alone, never a
        checkpoint payload; deleted runs are hidden like on every normal read path."""
        run = await self.store.get_run(org_id, flow_run_id)
        if run.execution_owner is ExecutionOwner.LEGACY_INTERPRETER:
            raise FailedPreconditionError(
                f"run {flow_run_id} is owned by the legacy interpreter: it has no plan, "
                "steps or checkpoints; read it with GetRun (compatibility projection)",
                reason="legacy_owned_run",
            )
        support = await self.store.support_view(org_id, flow_run_id)
        async with transaction(self._engine, readonly=True) as conn:
            (view,) = await self._views(conn, [support.run])
            row = await repo.get_plan_txn(conn, org_id, support.run.plan_id)
            if row is None:  # the FK makes this impossible; answer like a missing run
                raise NotFoundError("flow_run", flow_run_id)
            plan = row.plan()
            ids: dict[tuple[str, int], str] = {}
            for pin in plan.subflows:
                fv = await repo.get_flow_version_by_number_txn(
                    conn, org_id, pin.api_name, pin.version
                )
                if fv is not None:
                    ids[(pin.api_name, pin.version)] = fv.flow_version_id
            deps = await dependency_support_txn(conn, org_id, flow_run_id, await db_now(conn))
            effects = await effect_support_txn(conn, org_id, flow_run_id)
        return RunSupport(view, support, row, plan, ids, tuple(deps), tuple(effects))

    # --- delete and cancel -------------------------------------------------------------

    async def view_txn(self, conn: AsyncConnection, run: RunRecord) -> RunView:
        """The run's public view in ``conn`` (for :mod:`runtime_svc.runs.operate`)."""
        return await self._view_txn(conn, run)

    async def run_once(
        self,
        key: RequestKey,
        work: Callable[[AsyncConnection], Awaitable[T]],
        encode: Callable[[T], bytes],
    ) -> bytes:
        """``work`` and its request-ledger row in one transaction; a retry replays."""
        return await self._once(key, work, encode)

    @property
    def engine(self) -> AsyncEngine:
        return self._engine

    async def _once(
        self,
        key: RequestKey,
        work: Callable[[AsyncConnection], Awaitable[T]],
        encode: Callable[[T], bytes],
    ) -> bytes:
        done = await self._ledger.execute(self._engine, key, work, encode)
        if done.response is None:  # pragma: no cover - these encoders always answer
            raise FailedPreconditionError("the request produced no response", reason="internal")
        return done.response

    def _require_legacy(self) -> LegacyInterviewService:
        if self._legacy is None:
            raise FailedPreconditionError(
                "this process serves no legacy interpreter owner", reason="legacy_owner_absent"
            )
        return self._legacy

    async def _legacy_owned(self, org_id: str, flow_run_id: str) -> bool:
        """Whether ``flow_run_id`` is a LegacyInterpreter run (§20: its lifecycle writes
        are the legacy owner's typed, version-fenced commands). A missing run is left to
        the V2 path, which answers ``NOT_FOUND``."""
        try:
            run = await self.store.get_run(org_id, flow_run_id, include_deleted=True)
        except NotFoundError:
            return False
        return run.execution_owner is ExecutionOwner.LEGACY_INTERPRETER

    async def _delete_legacy(self, org: str, flow_run_id: str, expected: int | None) -> RunView:
        # §10.1: the typed LegacyInterpreter/0/StateVersion cancellation-and-tombstone.
        await self._require_legacy().delete(org, flow_run_id, expected_version=expected)
        return await self.get_run(org, flow_run_id, include_deleted=True)

    async def _cancel_legacy(self, org: str, flow_run_id: str, expected: int | None) -> RunView:
        after = await self._require_legacy().cancel(org, flow_run_id, expected_version=expected)
        return await self.get_run(org, after.flow_run_id, include_deleted=True)

    async def delete_run(
        self,
        identity: TrustedIdentity,
        flow_run_id: str,
        *,
        expected_state_version: int | None = None,
    ) -> RunView:
        """§10.1 public delete: authorize (step 1), then the store's soft delete plus
        fenced cancellation (steps 2-5), the view read in the same transaction.
        Repeating it returns the same outcome.

        Raises:
            PermissionDeniedError: the credential lacks :data:`DELETE_ROLE` (checked before
                any read or write).
            NotFoundError: missing or in another org.
            StateVersionMismatchError: the root is not at ``expected_state_version``
                (``None``: no expectation), compared in the store's compare-and-swap.
        """
        _require_role(identity, DELETE_ROLE, "delete")
        org = identity.org_id
        if await self._legacy_owned(org, flow_run_id):
            return await self._delete_legacy(org, flow_run_id, expected_state_version)
        return await run_in_transaction(
            self._engine,
            lambda conn: self._delete_txn(conn, org, flow_run_id, expected_state_version),
        )

    async def delete_run_once(
        self,
        identity: TrustedIdentity,
        flow_run_id: str,
        key: RequestKey,
        encode: Callable[[RunView], bytes],
        *,
        expected_state_version: int | None = None,
    ) -> bytes:
        """:meth:`delete_run` deduplicated on ``key`` (the role is checked first)."""
        _require_role(identity, DELETE_ROLE, "delete")
        org = identity.org_id
        if await self._legacy_owned(org, flow_run_id):
            return await self._ledger.once(
                self._engine,
                key,
                lambda: self._delete_legacy(org, flow_run_id, expected_state_version),
                encode,
            )
        return await self._once(
            key,
            lambda conn: self._delete_txn(conn, org, flow_run_id, expected_state_version),
            encode,
        )

    async def _delete_txn(
        self, conn: AsyncConnection, org: str, flow_run_id: str, expected: int | None
    ) -> RunView:
        await self.store.cancel_txn(
            conn, org, flow_run_id, delete=True, expected_state_version=expected
        )
        run = await get_run_txn(conn, org, flow_run_id, include_deleted=True)
        return await self._view_txn(conn, run)

    async def cancel_run(
        self,
        identity: TrustedIdentity,
        flow_run_id: str,
        *,
        expected_state_version: int | None = None,
    ) -> RunView:
        """Request cancellation (§11.1 ``CancelRequested``); idempotent while the run is
        cancelling or cancelled.

        Raises:
            PermissionDeniedError: the credential lacks :data:`CANCEL_ROLE`.
            NotFoundError: missing, foreign or deleted.
            FailedPreconditionError: the run already ended otherwise (Succeeded,
                TerminalFailed, Quarantined); nothing is written.
            StateVersionMismatchError: the root is not at ``expected_state_version``.
        """
        _require_role(identity, CANCEL_ROLE, "cancel")
        org = identity.org_id
        if await self._legacy_owned(org, flow_run_id):
            return await self._cancel_legacy(org, flow_run_id, expected_state_version)
        return await run_in_transaction(
            self._engine,
            lambda conn: self._cancel_txn(conn, org, flow_run_id, expected_state_version),
        )

    async def cancel_run_once(
        self,
        identity: TrustedIdentity,
        flow_run_id: str,
        key: RequestKey,
        encode: Callable[[RunView], bytes],
        *,
        expected_state_version: int | None = None,
    ) -> bytes:
        """:meth:`cancel_run` deduplicated on ``key`` (the role is checked first)."""
        _require_role(identity, CANCEL_ROLE, "cancel")
        org = identity.org_id
        if await self._legacy_owned(org, flow_run_id):
            return await self._ledger.once(
                self._engine,
                key,
                lambda: self._cancel_legacy(org, flow_run_id, expected_state_version),
                encode,
            )
        return await self._once(
            key,
            lambda conn: self._cancel_txn(conn, org, flow_run_id, expected_state_version),
            encode,
        )

    async def _cancel_txn(
        self, conn: AsyncConnection, org: str, flow_run_id: str, expected: int | None
    ) -> RunView:
        await self.store.cancel_txn(
            conn, org, flow_run_id, delete=False, expected_state_version=expected
        )
        run = await get_run_txn(conn, org, flow_run_id)
        if run.state in TERMINAL_RUN_STATES - {RunState.CANCELLED}:
            # Raised inside the transaction: a refused cancellation records nothing.
            raise FailedPreconditionError(
                f"the run already ended ({run.state.code}); only a non-terminal run "
                "can be cancelled",
                reason="run_terminal",
            )
        return await self._view_txn(conn, run)
