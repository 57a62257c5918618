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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.atomic import AtomicRunner
from runtime_svc.compiler.kinds import ExecutionProfile
from runtime_svc.compiler.plan import ExecutionPlan
from runtime_svc.definitions import repository as repo
from runtime_svc.kernel import (
    CheckpointInput,
    FlowRunStateStore,
    RunRecord,
    RunState,
    StartRunRequest,
    SupportView,
)
from runtime_svc.kernel.states import TERMINAL_RUN_STATES, ExecutionOwner
from runtime_svc.legacy.service import LegacyInterviewService
from runtime_svc.migration.cohorts import choose_owner_txn
from runtime_svc.migration.protocol import V2AdmissionClosedError
from runtime_svc.runs.inputs import validate_input_variables
from runtime_svc.runs.keys import start_key
from runtime_svc.runs.listing import ListFilters, list_runs_txn
from runtime_svc.runs.resolve import (
    FlowTarget,
    ResolvedPlan,
    first_step_of,
    resolve_plan_by_id_txn,
    resolve_plan_txn,
)
from runtime_svc.runs.tokens import PageTokenCodec
from runtime_svc.schema import execution_plans
from services.auth import TrustedIdentity, TrustedRuntimeWorkScope
from services.db import transaction
from services.digest import versioned_digest
from services.errors import (
    AlreadyExistsError,
    ConflictError,
    FailedPreconditionError,
    FenceLostError,
    NotFoundError,
    PermissionDeniedError,
)

__all__ = [
    "CANCEL_ROLE",
    "DELETE_ROLE",
    "IdempotencyKeyReusedError",
    "RunService",
    "RunSupport",
    "RunView",
    "StartOutcome",
]

#: Role a credential needs for the public delete (§10.1 step 1).
DELETE_ROLE = "flow.runs.delete"
#: Role a credential needs to cancel a run.
CANCEL_ROLE = "flow.runs.cancel"


@dataclass(frozen=True)
class RunView:
    """A run with what its public view derives from other rows."""

    run: RunRecord
    flow_api_name: str
    plan_digest: str
    output_variables: Mapping[str, Any] | None = None


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
        legacy: the LegacyInterpreter owner (§20): new runs whose cohort selects it are
            admitted there, and reads/deletes/cancels of its runs are routed to it;
            ``None`` admits V2 only (a legacy-owned choice then fails closed).
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
        legacy: LegacyInterviewService | None = None,
    ) -> None:
        self._engine = engine
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
        async with transaction(self._engine, readonly=True) as conn:
            if isinstance(target, FlowTarget):
                resolved = await resolve_plan_txn(conn, scope, target)
            else:
                resolved = await resolve_plan_by_id_txn(conn, scope, target)
        inputs = validate_input_variables(
            resolved.variables, input_variables, max_bytes=self.store.max_checkpoint_bytes
        )
        key = start_key(resolved.flow_api_name, idempotency_key) if idempotency_key else None
        if self._legacy is not None and await self._legacy_owned_start(scope, resolved, key):
            return await self._start_legacy(scope, resolved, inputs, key)
        first = first_step_of(resolved.plan, resolved.row.execution_profile)
        request = StartRunRequest(
            plan_id=resolved.row.plan_id,
            first_step=first,
            input=CheckpointInput(
                context={"variables": inputs},
                plan_cursor={"step": first.plan_step_key},
            ),
            idempotency_key=key,
        )
        try:
            result = await self._create(scope, request)
        except V2AdmissionClosedError:
            # Admission closed between the owner choice and the insert (§20.9): the new
            # run returns to the legacy cohort; nothing V2 was written.
            if self._legacy is None:
                raise
            return await self._start_legacy(scope, resolved, inputs, key)
        run = result.run
        completed = run.state in TERMINAL_RUN_STATES
        if (
            not completed
            and self._atomic is not None
            and resolved.row.execution_profile == (ExecutionProfile.BOUNDED_ATOMIC.value)
        ):
            # §18.3: the one logical mutation step runs now; the terminal result returns
            # when it completes within the API budget, the run identity otherwise.
            budget = min(max(wait_budget_s, self._atomic_budget_s), self._max_wait_s)
            run = await self._atomic.run(scope.org_id, run.flow_run_id, budget)
            completed = run.state in TERMINAL_RUN_STATES
        if not completed and wait_budget_s > 0:
            run = await self._wait(scope.org_id, run, min(wait_budget_s, self._max_wait_s))
            completed = run.state in TERMINAL_RUN_STATES
        view = await self._view(run, resolved)
        return StartOutcome(view, completed=completed, existing_run=not result.created)

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

    async def _start_legacy(
        self,
        scope: TrustedRuntimeWorkScope,
        resolved: ResolvedPlan,
        inputs: Mapping[str, Any],
        key: str | None,
    ) -> StartOutcome:
        """``CreateInterview`` on the legacy owner; its first segment runs now."""
        assert self._legacy is not None
        digest = versioned_digest(
            "legacy-start-request",
            {
                "scope": [scope.org_id, scope.app_installation_id, scope.runtime_capability_id,
                          scope.runtime_work_binding_digest],
                "flow_version_id": resolved.row.flow_version_id,
                "input": dict(inputs),
            },
        )  # fmt: skip
        try:
            interview, created = await self._legacy.start(
                scope,
                resolved.row.flow_version_id,
                inputs,
                idempotency_key=key,
                request_digest=digest,
            )
        except ConflictError as exc:
            if isinstance(exc, FenceLostError) or key is None:
                raise
            raise IdempotencyKeyReusedError() from exc
        run = await self.store.get_run(scope.org_id, interview.flow_run_id, include_deleted=True)
        view = RunView(run, resolved.flow_api_name, "", interview.outputs())
        return StartOutcome(view, completed=interview.terminal, existing_run=not created)

    async def _create(self, scope: TrustedRuntimeWorkScope, request: StartRunRequest) -> Any:
        # The store reads a lost insert race back and compares request digests, so a
        # concurrent duplicate is a replay and only a different body is a conflict.
        try:
            return await self.store.create_run(scope, request)
        except ConflictError as exc:
            if isinstance(exc, FenceLostError) or request.idempotency_key is None:
                raise
            raise IdempotencyKeyReusedError() from exc

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

    async def _outputs(self, run: RunRecord, plan: ExecutionPlan) -> Mapping[str, Any] | None:
        if run.state is not RunState.SUCCEEDED or run.current_checkpoint_id is None:
            return None
        checkpoint = await self.store.get_checkpoint(
            run.org_id, run.flow_run_id, run.current_checkpoint_id
        )
        context = json.loads(checkpoint.context_json)
        values = context.get("variables", {}) if isinstance(context, dict) else {}
        declared = {v.name for v in plan.variables if v.output}
        return {k: v for k, v in values.items() if k in declared}

    async def _view(self, run: RunRecord, resolved: ResolvedPlan) -> RunView:
        return RunView(
            run,
            resolved.flow_api_name,
            resolved.row.plan_digest,
            await self._outputs(run, resolved.plan),
        )

    # --- reads -------------------------------------------------------------------------

    async def _views(self, conn: AsyncConnection, runs: Iterable[RunRecord]) -> list[RunView]:
        runs = list(runs)
        if not runs:
            return []
        org = runs[0].org_id
        versions = await repo.get_flow_versions_txn(conn, org, [r.flow_version_id for r in runs])
        p = execution_plans.c
        plan_ids = sorted({r.plan_id for r in runs})
        digests = {
            row.plan_id: row.plan_digest
            for row in await conn.execute(
                select(p.plan_id, p.plan_digest).where(p.org_id == org, p.plan_id.in_(plan_ids))
            )
        }
        out = []
        for r in runs:
            version = versions.get(r.flow_version_id)
            out.append(
                RunView(
                    r,
                    "" if version is None else version.flow_api_name,
                    str(digests.get(r.plan_id, "")),
                )
            )
        return out

    async def _with_outputs(self, view: RunView) -> RunView:
        if view.run.state is not RunState.SUCCEEDED:
            return view
        if view.run.execution_owner is ExecutionOwner.LEGACY_INTERPRETER:
            if self._legacy is None:
                return view
            interview = await self._legacy.get(
                view.run.org_id, view.run.flow_run_id, include_deleted=True
            )
            return RunView(view.run, view.flow_api_name, "", interview.outputs())
        async with transaction(self._engine, readonly=True) as conn:
            row = await repo.get_plan_txn(conn, view.run.org_id, view.run.plan_id)
        if row is None:
            return view
        return RunView(
            view.run,
            view.flow_api_name,
            view.plan_digest,
            await self._outputs(view.run, row.plan()),
        )

    async def get_run(
        self, org_id: str, flow_run_id: str, *, include_deleted: bool = False
    ) -> RunView:
        """The run ``(org_id, flow_run_id)``; ``NotFoundError`` when missing, foreign or
        soft-deleted (§10.1 step 6)."""
        run = await self.store.get_run(org_id, flow_run_id, include_deleted=include_deleted)
        async with transaction(self._engine, readonly=True) as conn:
            (view,) = await self._views(conn, [run])
        return await self._with_outputs(view)

    async def list_runs(
        self, org_id: str, filters: ListFilters, page_size: int = 0, page_token: str = ""
    ) -> tuple[list[RunView], str]:
        """One page of the org's visible runs and the next token (``""`` at the end)."""
        async with transaction(self._engine, readonly=True) as conn:
            runs, token = await list_runs_txn(
                conn, org_id, filters, page_size, page_token, self._tokens
            )
            return await self._views(conn, runs), token

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
        return RunSupport(view, support, row, plan, ids)

    # --- delete and cancel -------------------------------------------------------------

    def _require_legacy(self) -> LegacyInterviewService:
        if self._legacy is None:
            raise FailedPreconditionError(
                "this process serves no legacy interpreter owner", reason="legacy_owner_absent"
            )
        return self._legacy

    async def _check_version(self, org_id: str, flow_run_id: str, expected: int) -> RunRecord:
        run = await self.store.get_run(org_id, flow_run_id, include_deleted=True)
        if expected and run.state_version != expected and not run.is_deleted:
            raise FailedPreconditionError(
                f"expected_state_version {expected} is stale (current {run.state_version})",
                reason="state_version_mismatch",
            )
        return run

    async def delete_run(
        self, identity: TrustedIdentity, flow_run_id: str, *, expected_state_version: int = 0
    ) -> RunView:
        """§10.1 public delete: authorize (step 1), then the store's soft delete plus
        fenced cancellation (steps 2-5). Repeating it returns the same outcome.

        Raises:
            PermissionDeniedError: the credential lacks :data:`DELETE_ROLE` (checked before
                any read or write).
            NotFoundError: missing or in another org.
            FailedPreconditionError: ``expected_state_version`` is stale.
        """
        _require_role(identity, DELETE_ROLE, "delete")
        org = identity.org_id
        run = await self._check_version(org, flow_run_id, expected_state_version)
        if run.execution_owner is ExecutionOwner.LEGACY_INTERPRETER:
            # §10.1: the typed LegacyInterpreter/0/StateVersion cancellation-and-tombstone.
            await self._require_legacy().delete(
                org, flow_run_id, expected_version=expected_state_version or None
            )
            return await self.get_run(org, flow_run_id, include_deleted=True)
        await self.store.delete_run(org, flow_run_id)
        return await self.get_run(org, flow_run_id, include_deleted=True)

    async def cancel_run(
        self, identity: TrustedIdentity, flow_run_id: str, *, expected_state_version: int = 0
    ) -> RunView:
        """Request cancellation (§11.1 ``CancelRequested``); idempotent while the run is
        cancelling or cancelled.

        Raises:
            PermissionDeniedError: the credential lacks :data:`CANCEL_ROLE`.
            NotFoundError: missing, foreign or deleted.
            FailedPreconditionError: the run already ended otherwise (Succeeded,
                TerminalFailed, Quarantined), or ``expected_state_version`` is stale.
        """
        _require_role(identity, CANCEL_ROLE, "cancel")
        org = identity.org_id
        before = await self._check_version(org, flow_run_id, expected_state_version)
        if before.is_deleted:
            raise NotFoundError("flow_run", flow_run_id)
        if before.execution_owner is ExecutionOwner.LEGACY_INTERPRETER:
            after = await self._require_legacy().cancel(
                org, flow_run_id, expected_version=expected_state_version or None
            )
            return await self.get_run(org, after.flow_run_id, include_deleted=True)
        await self.store.request_cancel(org, flow_run_id)
        view = await self.get_run(org, flow_run_id)
        if view.run.state in TERMINAL_RUN_STATES - {RunState.CANCELLED}:
            raise FailedPreconditionError(
                f"the run already ended ({view.run.state.code}); only a non-terminal run "
                "can be cancelled",
                reason="run_terminal",
            )
        return view
