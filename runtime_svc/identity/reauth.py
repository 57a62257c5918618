"""Per-step reauthorization (§17.2) for the step worker: one call before the business
transaction.

:meth:`Reauthorizer.reauthorize` reads the run's stored identity and the principal
directory, applies :func:`~runtime_svc.identity.rules.decide` and maps the verdict onto
the step: ``None`` (act — as the initiating principal, or as the declared system identity
after an audited handoff), a :class:`~runtime_svc.worker.executor.StepOutcome` that takes
the step's compiled fault path without acting, or a ``StepFault`` whose code is the safe
reason (the worker records it as the attempt's terminal failure and the run fails).
Every denial and handoff appends an ``audit_records`` row with the reason code — ids and
codes only.

Staleness bound: directory states are cached per (org, principal) for ``cache_ttl_s``
(``FLOW_REAUTH_CACHE_SECONDS``), so a step starting at most that long after a principal
was disabled or its permissions changed may still act on the previous state; ``0``
reads the directory for every step. A cache miss costs one short read-only transaction
(run identity and directory rows together); a hit costs none. A run's stored identity
never changes after it is created and is cached without expiry (bounded LRU).
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.compiler import ExecutionPlan, PlanStep, StepKind
from runtime_svc.compiler.identity import ExecutionPrincipalMode
from runtime_svc.compiler.kinds import EdgeKind
from runtime_svc.kernel.model import LeaseFence
from runtime_svc.schema import audit_records
from runtime_svc.worker.executor import StepFault, StepOutcome, advance_to, context_of, env_of
from services.db import db_now, transaction
from services.digest import canonical_json

from .directory import principal_states_txn, read_run_identity_txn
from .rules import (
    Allowed,
    DenialOutcome,
    Handoff,
    PrincipalState,
    RunIdentity,
    Verdict,
    decide,
    reauthorizes,
)

__all__ = ["AUDIT_ACTOR_KIND", "Reauthorizer", "fault_target"]

#: ``audit_records.actor_kind`` of a reauthorization decision.
AUDIT_ACTOR_KIND = "principal"
_MAX_RUNS = 10_000
_MAX_PRINCIPALS = 10_000


def fault_target(plan: ExecutionPlan, step: PlanStep) -> str | None:
    """The compiled fault successor of ``step`` (an effect submit's is its completion's),
    or ``None`` when the step has no fault path."""
    transitions = step.transitions
    if step.kind is StepKind.EFFECT_SUBMIT and step.effect is not None:
        transitions = plan.step(step.effect.completion_step).transitions
    return next((t.target for t in transitions if t.kind is EdgeKind.FAULT), None)


class Reauthorizer:
    """Reauthorizes durable steps against the principal directory (module docstring).

    Args:
        engine: the runtime database.
        cache_ttl_s: how long a directory state is reused (the staleness bound).
        clock: monotonic seconds (tests).
    """

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        cache_ttl_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._engine = engine
        self._ttl = max(0.0, cache_ttl_s)
        self._clock = clock
        self._runs: OrderedDict[tuple[str, str], RunIdentity] = OrderedDict()
        self._states: OrderedDict[tuple[str, str], tuple[float, PrincipalState | None]]
        self._states = OrderedDict()

    async def reauthorize(
        self,
        org_id: str,
        fence: LeaseFence,
        plan: ExecutionPlan,
        step: PlanStep,
        context: Mapping[str, Any],
    ) -> StepOutcome | None:
        """Decide and apply ``step``'s reauthorization (module docstring).

        Returns:
            ``None`` when the step acts; the fault-path outcome when it must not.

        Raises:
            StepFault: the policy is terminal failure (code = the safe reason).
        """
        declared = step.principal
        if declared is None or not reauthorizes(step.kind):
            return None
        run, states = await self._load(org_id, fence.flow_run_id, declared.system_identity)
        initiating = (
            states.get(run.initiating_principal_id) if run.initiating_principal_id else None
        )
        system = states.get(declared.system_identity) if declared.system_identity else None
        verdict = decide(run, declared, initiating, system)
        if isinstance(verdict, Allowed):
            return None
        await self._audit(org_id, fence, step, run, verdict)
        if isinstance(verdict, Handoff):
            return None
        target = fault_target(plan, step)
        if verdict.outcome is DenialOutcome.FAULT_PATH and target is not None:
            env = env_of(context)
            advance = advance_to(plan, target, verdict.reason.value, env)
            return StepOutcome(context_of(env, context), (), advance)
        raise StepFault(verdict.reason.value, "reauthorization denied")

    def forget(self, org_id: str, principal_id: str) -> None:
        """Drop a cached directory state (the directory's writer in this process)."""
        self._states.pop((org_id, principal_id), None)

    async def _load(
        self, org_id: str, flow_run_id: str, system_identity: str | None
    ) -> tuple[RunIdentity, dict[str, PrincipalState | None]]:
        now = self._clock()
        run = self._runs.get((org_id, flow_run_id))
        wanted: set[str] = set()
        if system_identity:
            wanted.add(system_identity)
        if run is not None and run.initiating_principal_id:
            wanted.add(run.initiating_principal_id)
        fresh: dict[str, PrincipalState | None] = {}
        for pid in list(wanted):
            hit = self._states.get((org_id, pid))
            if hit is not None and self._ttl > 0 and now - hit[0] < self._ttl:
                fresh[pid] = hit[1]
                wanted.discard(pid)
        if run is None or wanted:
            async with transaction(self._engine, readonly=True) as conn:
                if run is None:
                    run = await read_run_identity_txn(conn, org_id, flow_run_id)
                    if run.initiating_principal_id and run.initiating_principal_id not in fresh:
                        wanted.add(run.initiating_principal_id)
                found = await principal_states_txn(conn, org_id, wanted)
            self._remember_run(org_id, flow_run_id, run)
            for pid in wanted:
                fresh[pid] = found.get(pid)
                self._remember_state(org_id, pid, now, found.get(pid))
        return run, fresh

    def _remember_run(self, org_id: str, flow_run_id: str, run: RunIdentity) -> None:
        self._runs[(org_id, flow_run_id)] = run
        self._runs.move_to_end((org_id, flow_run_id))
        while len(self._runs) > _MAX_RUNS:
            self._runs.popitem(last=False)

    def _remember_state(
        self, org_id: str, pid: str, now: float, state: PrincipalState | None
    ) -> None:
        if self._ttl <= 0:
            return
        self._states[(org_id, pid)] = (now, state)
        self._states.move_to_end((org_id, pid))
        while len(self._states) > _MAX_PRINCIPALS:
            self._states.popitem(last=False)

    async def _audit(
        self,
        org_id: str,
        fence: LeaseFence,
        step: PlanStep,
        run: RunIdentity,
        verdict: Verdict,
    ) -> None:
        declared = step.principal
        if declared is None or isinstance(verdict, Allowed):  # pragma: no cover - guarded
            return
        if isinstance(verdict, Handoff):
            action, outcome = "flow_run.system_handoff", "system_handoff"
            acting: str | None = verdict.acting_principal_id
        else:
            action, outcome, acting = "flow_run.reauthorization_denied", verdict.outcome.value, None
        actor = (
            declared.system_identity
            if declared.mode is ExecutionPrincipalMode.SYSTEM
            else run.initiating_principal_id
        ) or "-"
        details: dict[str, Any] = {
            "reason": verdict.reason.value,
            "policy": declared.on_denied.value,
            "outcome": outcome,
            "mode": declared.mode.value,
            "plan_step_key": step.key,
            "authorization_context_digest": run.authorization_context_digest,
        }
        if acting is not None:
            details["acting_principal_id"] = acting
        async with transaction(self._engine) as conn:
            await conn.execute(
                audit_records.insert().values(
                    org_id=org_id,
                    audit_record_id=f"aud_{uuid.uuid4().hex}",
                    actor_kind=AUDIT_ACTOR_KIND,
                    actor_id=actor[:128],
                    action=action,
                    flow_run_id=fence.flow_run_id,
                    step_execution_id=fence.step_execution_id,
                    attempt_id=fence.attempt_id,
                    details=canonical_json(details).decode(),
                    occurred_at=await db_now(conn),
                )
            )
