"""Activation bindings (§7.4): activate, supersede, deactivate, blocked attempts.

Activation order, and why:

1. re-compile with the same compiler, from the plan's pinned catalog generation and
   metadata view, under the current policy generation and this binary's compiler
   version; a rejected compile is recorded as a BLOCKED activation attempt carrying its
   diagnostics and fails with :class:`ActivationBlockedError` — no plan is written
   (§7.4, §9.2: no silent fallback); a compile that yields another digest means the
   plan is stale (policy or compiler changed) and the caller must compile again;
   then check every dependency the plan declares against the runtime's producer
   registry: an unregistered producer, or one with neither notification nor bounded
   reconciliation, is a BLOCKED attempt naming the step (§10.5);
2. register retention references (catalog generation and metadata view) through the
   catalog API, held by this activation — before the activation can serve admission;
3. one transaction: lock the Flow's ACTIVE row, fence it to SUPERSEDED with the
   conditional UPDATE, insert the new ACTIVE row; the unique active slot per
   (org, Flow, installation, capability) makes a concurrent second winner impossible;
4. after commit, release the superseded activation's references unless a non-terminal
   run still uses its plan (in-flight runs keep their plan and its artifacts).

Reference holders are ``<plan id>/<activation id>``: each activation owns its own
references, so releasing an ended activation can never strip those of a later
re-activation of the same plan.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.admission.budgets import admission_notes
from runtime_svc.compiler import ExecutionPlan, PlanCompileError
from runtime_svc.definitions import repository as repo
from runtime_svc.definitions._util import Db, bounded_json, new_id
from runtime_svc.definitions.compiling import PlanCompiler
from runtime_svc.definitions.errors import ActivationBlockedError
from runtime_svc.definitions.inventory import DiagnosticValue, diagnostics_of
from runtime_svc.definitions.policy import PolicyGeneration
from runtime_svc.definitions.policy_store import PolicyStore
from runtime_svc.schema import MAX_SUMMARY_BYTES
from runtime_svc.waits.registry import ProducerRegistry
from services.auth import TrustedRuntimeWorkScope
from services.db import db_now
from services.digest import versioned_digest
from services.errors import (
    ConflictError,
    FailedPreconditionError,
    FlowError,
    InvalidArgumentError,
)

if TYPE_CHECKING:  # the catalog client imports this package (CatalogSnapshot)
    from runtime_svc.catalog_client import CatalogPort

__all__ = ["ActivationOutcome", "Activations", "PlanLookup"]

_log = logging.getLogger(__name__)

#: Attempts of an activation that lost the active-slot race to a concurrent activation.
_ACTIVATION_ATTEMPTS = 3


def _admission_diagnostics(
    org_id: str, policy: PolicyGeneration, plan: ExecutionPlan
) -> tuple[DiagnosticValue, ...]:
    """Info diagnostics naming the admission bounds (§16.3) that apply to ``plan``."""
    notes = admission_notes(
        policy.runtime_policy().admission_policy,
        org_id,
        plan.flow.api_name,
        plan.flow.version,
        plan.profile.value,
        [s.queue_class.value for s in plan.steps if s.queue_class is not None],
        [r.object for s in plan.steps for r in s.resources if r.object],
    )
    return tuple(DiagnosticValue("info", path, "admission_bound", msg) for path, msg in notes)


class _ActivationRace(Exception):
    """Another activation of the same Flow took the active slot first."""


@dataclass(frozen=True)
class ActivationOutcome:
    """The ACTIVE activation and the plan's non-blocking diagnostics."""

    activation: repo.ActivationRow
    diagnostics: tuple[DiagnosticValue, ...]
    superseded: repo.ActivationRow | None = None


@dataclass(frozen=True)
class PlanLookup:
    """A stored plan and its decoded value."""

    row: repo.PlanRow
    plan: ExecutionPlan


class Activations(Db):
    """Activation bindings of every org in one database."""

    def __init__(
        self,
        engine: AsyncEngine,
        catalog: CatalogPort,
        compiler: PlanCompiler,
        policies: PolicyStore,
        flows: Callable[[str, str], Awaitable[repo.FlowVersionRow]],
        plans: Callable[[TrustedRuntimeWorkScope, str], Awaitable[PlanLookup]],
        *,
        producers: ProducerRegistry | None = None,
    ) -> None:
        super().__init__(engine)
        self._catalog = catalog
        self._compiler = compiler
        self._policies = policies
        self._flows = flows
        self._plans = plans
        self._producers = producers or ProducerRegistry()

    async def activate(
        self,
        scope: TrustedRuntimeWorkScope,
        request_id: str,
        flow_version_id: str,
        plan_id: str,
        plan_digest: str,
    ) -> ActivationOutcome:
        """Bind a Flow version to one compiled plan; supersede the Flow's previous binding.

        Raises:
            NotFoundError: unknown Flow version in the org, or no such plan in the
                complete work scope (a plan of another installation, capability or
                binding answers exactly like a missing one, before any other check).
            FailedPreconditionError: the plan belongs to another version, its digest is
                not ``plan_digest``, or it is stale (the current policy or compiler yields
                another plan: compile again).
            ActivationBlockedError: the re-compile was rejected (diagnostics stored).
        """
        if not plan_id:
            raise InvalidArgumentError("plan_id is required", field_path="plan_id")
        if not plan_digest:
            raise InvalidArgumentError("plan_digest is required", field_path="plan_digest")
        flow = await self._flows(scope.org_id, flow_version_id)
        view = await self._plans(scope, plan_id)
        row = view.row
        if row.plan_id != plan_id:
            raise InvalidArgumentError("plan_id must be a plan id", field_path="plan_id")
        if row.flow_version_id != flow.flow_version_id:
            raise FailedPreconditionError(
                f"plan {plan_id} was compiled from another Flow version",
                reason="plan_flow_version_mismatch",
            )
        if row.plan_digest != plan_digest:
            raise FailedPreconditionError(
                f"plan {plan_id} has digest {row.plan_digest}, not {plan_digest}",
                reason="plan_digest_mismatch",
            )
        if not view.plan.verify():
            raise FlowError(f"plan {plan_id} failed its digest check", reason="plan_integrity")

        # Step 1: the same compiler, from the plan's pinned generation and view, under the
        # current policy generation and this binary's compiler version.
        snapshot = await self._catalog.load_snapshot(
            scope, row.catalog_generation_id, row.catalog_digest
        )
        policy = await self._policies.current(scope.org_id)
        outcome, _, _ = await self._compiler.compile(flow, snapshot, policy)
        if isinstance(outcome, PlanCompileError):
            diagnostics = diagnostics_of(outcome)
            attempt = await self._record_blocked(scope, request_id, flow, row, policy, diagnostics)
            raise ActivationBlockedError(attempt, diagnostics)
        if outcome.plan_digest != row.plan_digest:
            raise FailedPreconditionError(
                f"plan {plan_id} is stale: compiled under policy v{row.policy_version} and "
                f"{row.compiler_version}, the current policy v{policy.version} and "
                f"{self._compiler.compiler_version} give another plan ({outcome.plan_digest}); "
                "compile the Flow version again and activate the new plan",
                reason="plan_stale",
            )
        diagnostics = diagnostics_of(outcome) + _admission_diagnostics(
            scope.org_id, policy, outcome
        )
        # §10.5: every dependency names a registered producer with a notification or a
        # bounded reconciliation; otherwise the wait could never resolve.
        producer_issues = [
            DiagnosticValue("error", f"steps[{i.step_key}]", i.code, i.message)
            for i in self._producers.check_plan(outcome)
        ]
        if producer_issues:
            attempt = await self._record_blocked(
                scope, request_id, flow, row, policy, producer_issues
            )
            raise ActivationBlockedError(attempt, tuple(producer_issues))

        async def current_active(conn: AsyncConnection) -> repo.ActivationRow | None:
            return await repo.active_activation_txn(
                conn,
                scope.org_id,
                flow.flow_api_name,
                scope.app_installation_id,
                scope.runtime_capability_id,
            )

        existing = await self._read(current_active)
        if existing is not None and existing.plan_id == row.plan_id:
            return ActivationOutcome(existing, diagnostics)  # identical re-activation

        for _ in range(_ACTIVATION_ATTEMPTS):
            activation_id = new_id("act")
            # Step 2: retention references before the activation can serve admission.
            await self._catalog.register_plan_references(
                scope,
                self._holder(row.plan_id, activation_id),
                row.catalog_generation_id,
                row.catalog_digest,
                row.metadata_view_digest,
            )

            async def txn(
                conn: AsyncConnection, aid: str = activation_id
            ) -> tuple[repo.ActivationRow, repo.ActivationRow | None]:
                return await self._activate_txn(conn, scope, flow, row, aid)

            try:
                active, superseded = await self._txn(txn)
            except _ActivationRace:
                await self._release(scope, row, activation_id)
                continue
            if active.activation_id != activation_id:
                # A concurrent identical activation won; ours registered for nothing.
                await self._release(scope, row, activation_id)
            if superseded is not None and superseded.plan_id is not None:
                await self._release_if_unused(superseded)
            return ActivationOutcome(active, diagnostics, superseded)
        raise ConflictError(
            f"Flow {flow.flow_api_name} is being activated concurrently; retry",
            entity="FlowActivation",
            key=flow.flow_api_name,
        )

    async def _activate_txn(
        self,
        conn: AsyncConnection,
        scope: TrustedRuntimeWorkScope,
        flow: repo.FlowVersionRow,
        plan: repo.PlanRow,
        activation_id: str,
    ) -> tuple[repo.ActivationRow, repo.ActivationRow | None]:
        # Step 3: lock the Flow's ACTIVE row, fence it to SUPERSEDED, insert the new one.
        now = await db_now(conn)
        current = await repo.active_activation_txn(
            conn,
            scope.org_id,
            flow.flow_api_name,
            scope.app_installation_id,
            scope.runtime_capability_id,
            for_update=True,
        )
        if current is not None and current.plan_id == plan.plan_id:
            return current, None
        if current is not None:
            await repo.end_activation_txn(conn, current, repo.SUPERSEDED, now)
        inserted = await repo.insert_activation_txn(
            conn,
            {
                "org_id": scope.org_id,
                "app_installation_id": scope.app_installation_id,
                "runtime_capability_id": scope.runtime_capability_id,
                "runtime_work_binding_digest": scope.runtime_work_binding_digest,
                "activation_id": activation_id,
                "flow_version_id": flow.flow_version_id,
                "flow_api_name": flow.flow_api_name,
                "trigger_binding_digest": plan.trigger_binding_digest,
                "plan_id": plan.plan_id,
                "state": repo.ACTIVE,
                "active_slot": 1,
                "attempt_diagnostics": None,
                "state_version": 0,
                "created_at": now,
                "activated_at": now,
                "superseded_at": None,
            },
        )
        if not inserted:
            raise _ActivationRace()
        active = await repo.get_activation_txn(conn, scope.org_id, activation_id)
        if active is None:  # inserted by this very transaction: a broken invariant
            raise FlowError("activation vanished inside its transaction", reason="internal")
        return active, current

    async def _record_blocked(
        self,
        scope: TrustedRuntimeWorkScope,
        request_id: str,
        flow: repo.FlowVersionRow,
        plan: repo.PlanRow,
        policy: PolicyGeneration,
        diagnostics: Sequence[DiagnosticValue],
    ) -> str:
        """Store a BLOCKED activation attempt with its diagnostics (no plan row)."""
        # Keyed by the request id within the complete work scope, so a retried request
        # records one attempt and another installation's reuse of the id its own.
        seed = [
            scope.org_id,
            scope.app_installation_id,
            scope.runtime_capability_id,
            scope.runtime_work_binding_digest,
            "activate",
            request_id or new_id("req"),
            flow.flow_version_id,
        ]
        attempt_id = "act_" + versioned_digest("activation-attempt", seed).rsplit(":", 1)[1][:32]
        entries = [d.to_dict() for d in diagnostics]
        body: dict[str, Any] = {
            "requested_plan_id": plan.plan_id,
            "requested_plan_digest": plan.plan_digest,
            "policy_version": policy.version,
            "compiler_version": self._compiler.compiler_version,
            "catalog_generation_id": plan.catalog_generation_id,
            "diagnostics": entries,
        }
        text = repo.to_json(body)
        if len(text.encode()) > MAX_SUMMARY_BYTES:
            body["diagnostics"] = json.loads(bounded_json(entries, MAX_SUMMARY_BYTES // 2))
            text = repo.to_json(body)

        async def txn(conn: AsyncConnection) -> None:
            now = await db_now(conn)
            await repo.insert_activation_txn(
                conn,
                {
                    "org_id": scope.org_id,
                    "app_installation_id": scope.app_installation_id,
                    "runtime_capability_id": scope.runtime_capability_id,
                    "runtime_work_binding_digest": scope.runtime_work_binding_digest,
                    "activation_id": attempt_id,
                    "flow_version_id": flow.flow_version_id,
                    "flow_api_name": flow.flow_api_name,
                    "trigger_binding_digest": plan.trigger_binding_digest,
                    "plan_id": None,
                    "state": repo.BLOCKED,
                    "active_slot": None,
                    "attempt_diagnostics": text,
                    "state_version": 0,
                    "created_at": now,
                    "activated_at": None,
                    "superseded_at": None,
                },
            )

        await self._txn(txn)
        return attempt_id

    @staticmethod
    def _holder(plan_id: str, activation_id: str) -> str:
        # One holder per activation: a later re-activation of the same plan registers its
        # own references, so releasing an ended activation can never strip a live one.
        return f"{plan_id}/{activation_id}"

    async def _release(
        self, scope: TrustedRuntimeWorkScope, plan: repo.PlanRow, activation_id: str
    ) -> None:
        try:
            await self._catalog.release_plan_references(
                scope,
                self._holder(plan.plan_id, activation_id),
                plan.catalog_generation_id,
                plan.catalog_digest,
                plan.metadata_view_digest,
            )
        except FlowError:
            # Over-retention is safe; a retention sweep can release it later.
            _log.warning("could not release catalog references of %s", activation_id)

    async def _release_if_unused(self, ended: repo.ActivationRow) -> None:
        """Release an ended activation's references unless a live run still needs them."""
        if ended.plan_id is None:
            return
        plan_id = ended.plan_id

        async def read(conn: AsyncConnection) -> tuple[repo.PlanRow | None, bool]:
            plan = await repo.get_plan_txn(conn, ended.scope.org_id, plan_id)
            return plan, await repo.has_live_runs_txn(conn, ended.scope.org_id, plan_id)

        plan, live = await self._read(read)
        if plan is None or live:
            return
        await self._release(ended.scope, plan, ended.activation_id)

    async def deactivate(
        self,
        org_id: str,
        flow_version_id: str,
        *,
        app_installation_id: str | None = None,
        runtime_capability_id: str | None = None,
    ) -> repo.ActivationRow:
        """End the ACTIVE activation of a Flow version; idempotent once deactivated.

        In-flight runs keep their plan; its references are released only when no
        non-terminal run uses it.

        Raises:
            NotFoundError: unknown Flow version.
            FailedPreconditionError: the version was never active, or it is active in
                several installations/capabilities and the credential names none.
        """
        flow = await self._flows(org_id, flow_version_id)

        async def txn(conn: AsyncConnection) -> tuple[repo.ActivationRow, bool]:
            actives = await repo.active_activations_txn(
                conn,
                org_id,
                flow_version_ids=[flow.flow_version_id],
                app_installation_id=app_installation_id,
                runtime_capability_id=runtime_capability_id,
            )
            if not actives:
                done = await repo.latest_activation_for_version_txn(
                    conn, org_id, flow.flow_version_id, [repo.DEACTIVATED]
                )
                if done is None:
                    raise FailedPreconditionError(
                        f"Flow version {flow_version_id} is not active",
                        reason="flow_version_not_active",
                    )
                return done, False
            if len(actives) > 1:
                raise FailedPreconditionError(
                    f"Flow version {flow_version_id} is active in {len(actives)} installations "
                    "or capabilities; call with a credential scoped to one of them",
                    reason="activation_ambiguous",
                )
            current = actives[0]
            await repo.end_activation_txn(conn, current, repo.DEACTIVATED, await db_now(conn))
            ended = await repo.get_activation_txn(conn, org_id, current.activation_id)
            if ended is None:  # updated by this very transaction: a broken invariant
                raise FlowError("activation vanished inside its transaction", reason="internal")
            return ended, True

        ended, changed = await self._txn(txn)
        if changed:
            await self._release_if_unused(ended)
        return ended
