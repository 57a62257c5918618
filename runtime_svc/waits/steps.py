"""The ``DependencyWait`` step in the worker (§14, §14.2 steps 3-4, §14.4).

A wait step runs twice, each time through the ordinary claim → execute → commit path:

1. **enter** — its step execution has no dependency yet: :meth:`WaitSteps.prepare`
   evaluates the dependency's key (and a time wait's resume instant) against the
   checkpoint context, and the worker's commit transaction inserts the ``Pending``
   dependency (plus, for a record-condition wait, the object's watch registration)
   together with the ``EnterWait`` transition — step and root ``Waiting``, the output
   checkpoint as the resume point. Right after that commit
   (``CrashPoint.AFTER_WAIT_COMMIT``), :meth:`WaitSteps.after_commit` runs the required
   fresh-snapshot reconciliation (§14.2 step 4);
2. **resume** — after a root-first resolution moved the step back to ``Pending`` and the
   scheduler claimed it again, the dependency is ``Resolved``: the step follows its
   compiled ``resume`` transition like any committed step.

Durable times (deadline, a time wait's due time, the first probe) are set inside the
commit transaction from the database clock; no process timer exists. Deadlines never
exceed the maximum wait age of the plan's policy generation.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import UTC, date, datetime, timedelta
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.compiler import ExpressionEvalError, evaluate, parse_expression
from runtime_svc.compiler.expressions import ExpressionError
from runtime_svc.compiler.kinds import EdgeKind, ExpiryPolicy, StepKind
from runtime_svc.compiler.language import parse_duration
from runtime_svc.compiler.plan import DependencyDecl, ExecutionPlan, PlanStep
from runtime_svc.kernel.decisions import EnterWait
from runtime_svc.kernel.model import LeaseFence
from runtime_svc.kernel.store import CommitTail
from runtime_svc.kernel.store_waits import dependency_insert, new_dependency_id
from runtime_svc.kernel.wait_model import (
    DependencyState,
    ExpiryPolicyCode,
    NewDependency,
    WorkScopeKey,
)
from runtime_svc.waits import queries
from runtime_svc.waits.evidence import MAX_PRODUCER_KEY_CHARS
from runtime_svc.waits.record_producer import RecordWatches, record_key
from runtime_svc.waits.registry import ProducerFamily
from runtime_svc.waits.resolution import Clock, Matcher
from runtime_svc.worker.executor import StepFault, StepOutcome, advance_to, context_of, env_of
from services.auth import TrustedRuntimeWorkScope
from services.db import transaction
from services.db_batch import Write
from services.faults import CrashPoint, crash_point
from services.invariants import InvariantError

__all__ = ["PreparedWait", "WaitSteps", "parse_instant"]

_EXPIRY = {
    ExpiryPolicy.FAULT_PATH: ExpiryPolicyCode.FAULT_PATH,
    ExpiryPolicy.TERMINAL_FAILURE: ExpiryPolicyCode.TERMINAL_FAILURE,
    ExpiryPolicy.QUARANTINE: ExpiryPolicyCode.QUARANTINE,
}


def parse_instant(value: Any) -> datetime:
    """A time wait's ``until`` value as an aware UTC instant: an ISO-8601 date (midnight
    UTC) or date-time (no zone = UTC).

    Raises:
        StepFault: ``wait_until_invalid`` — not a date or date-time.
    """
    if isinstance(value, datetime):
        moment = value
    elif isinstance(value, date):
        moment = datetime(value.year, value.month, value.day)
    elif isinstance(value, str) and value.strip():
        try:
            moment = datetime.fromisoformat(value.strip())
        except ValueError:
            raise StepFault("wait_until_invalid", "until is not an ISO-8601 date") from None
    else:
        raise StepFault("wait_until_invalid", "until evaluated to no date")
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC)


def _value(text: str, env: Mapping[str, Any]) -> Any:
    try:
        return evaluate(parse_expression(text), env)
    except (ExpressionError, ExpressionEvalError) as exc:
        raise StepFault("expression_error", str(exc)) from exc


def _key_text(value: Any) -> str:
    if value is None or isinstance(value, bool | dict | list):
        raise StepFault("wait_key_invalid", "the wait key evaluated to no scalar value")
    text = str(value)
    if not text or len(text) > MAX_PRODUCER_KEY_CHARS:
        raise StepFault("wait_key_invalid", "the wait key is empty or too long")
    return text


@dataclass(frozen=True)
class PreparedWait:
    """A dependency ready to insert with the wait commit (times relative to its clock).

    Attributes:
        resume_at: a time wait's absolute due instant (``until``).
        resume_after_s: a time wait's duration.
        probe_after_s: the first reconciliation probe of a producer-backed wait.
        watch_object: the object a record-condition wait registers a watch for.
    """

    scope: WorkScopeKey
    dependency_id: str
    flow_run_id: str
    step_execution_id: str
    step_key: str
    producer_kind: str
    producer_key: str
    condition_digest: str
    expiry_policy: ExpiryPolicyCode
    deadline_after_s: int
    resume_at: datetime | None = None
    resume_after_s: int | None = None
    probe_after_s: float | None = None
    watch_object: str | None = None

    def dependency(self, now: datetime) -> NewDependency:
        """The dependency row, with its durable times from the commit's clock ``now``."""
        if self.resume_at is not None:
            due: datetime | None = self.resume_at
        elif self.resume_after_s is not None:
            due = now + timedelta(seconds=self.resume_after_s)
        elif self.probe_after_s is not None:
            due = now + timedelta(seconds=self.probe_after_s)
        else:
            due = None
        return NewDependency(
            dependency_id=self.dependency_id,
            flow_run_id=self.flow_run_id,
            step_execution_id=self.step_execution_id,
            producer_kind=self.producer_kind,
            producer_key=self.producer_key,
            condition_digest=self.condition_digest,
            deadline=now + timedelta(seconds=self.deadline_after_s),
            next_probe_at=due,
            expiry_policy=self.expiry_policy,
        )


def _resume_target(step: PlanStep) -> str | None:
    for t in step.transitions:
        if t.kind is EdgeKind.WAIT and t.label == "resume":
            return t.target
    return None


class WaitSteps:
    """Enter and resume ``DependencyWait`` steps (see the module docstring).

    Args:
        engine: the runtime database.
        matcher: the dependency-side matcher (fresh reconciliation).
        watches: the record-change producer's watch registry.
        clock: the durable clock (the worker's store clock).
        rng: jitter of the first probe.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        matcher: Matcher,
        watches: RecordWatches,
        clock: Clock,
        rng: random.Random | None = None,
    ) -> None:
        self._engine = engine
        self.matcher = matcher
        self._watches = watches
        self._clock = clock
        self._rng = rng or random.Random()  # noqa: S311 - probe jitter, not security

    async def prepare(
        self,
        org_id: str,
        fence: LeaseFence,
        scope: TrustedRuntimeWorkScope,
        plan: ExecutionPlan,
        policy_version: int,
        step: PlanStep,
        context: Mapping[str, Any],
    ) -> tuple[StepOutcome, PreparedWait | None]:
        """The step's outcome: ``EnterWait`` with the dependency to insert, or — when its
        dependency resolved — the ``resume`` transition.

        Raises:
            StepFault: a malformed plan step, a key or ``until`` that does not evaluate,
                or a dependency in a state a claimable step cannot have.
        """
        decl = step.dependency
        if step.kind is not StepKind.DEPENDENCY_WAIT or decl is None:
            raise StepFault("wait_without_dependency", f"{step.key} declares no dependency")
        env = env_of(context)
        async with transaction(self._engine, readonly=True) as conn:
            existing = await queries.dependency_of_step_txn(conn, org_id, fence.step_execution_id)
            bounds = await self.matcher.plans.bounds_txn(conn, org_id, policy_version)
        if existing is not None:
            if existing.state is not DependencyState.RESOLVED:
                raise StepFault(
                    "wait_dependency_state",
                    f"dependency is {existing.state.code}, not Resolved, on resume",
                )
            advance = advance_to(plan, _resume_target(step), None, env)
            return StepOutcome(context_of(env, context), (), advance), None
        work = WorkScopeKey(
            scope.org_id,
            scope.app_installation_id,
            scope.runtime_capability_id,
            scope.runtime_work_binding_digest,
        )
        spec = self.matcher.registry.for_declaration(decl.producer_kind)
        max_wait = bounds.max_wait_seconds
        deadline = min(decl.deadline_seconds or max_wait, max_wait)
        wait = PreparedWait(
            scope=work,
            dependency_id=new_dependency_id(),
            flow_run_id=fence.flow_run_id,
            step_execution_id=fence.step_execution_id,
            step_key=step.key,
            producer_kind=decl.producer_kind if spec is None else spec.kind,
            producer_key=decl.key,
            condition_digest=decl.condition_digest,
            expiry_policy=_EXPIRY[decl.expiry_policy],
            deadline_after_s=deadline,
            probe_after_s=bounds.policy.probe_initial_seconds * (0.5 + self._rng.random() / 2),
        )
        if spec is not None:
            wait = self._specialise(wait, spec.family, decl, env, fence)
        return StepOutcome(context_of(env, context), (), EnterWait()), wait

    def _specialise(
        self,
        wait: PreparedWait,
        family: ProducerFamily,
        decl: DependencyDecl,
        env: Mapping[str, Any],
        fence: LeaseFence,
    ) -> PreparedWait:
        if family is ProducerFamily.TIMER:
            key = f"timer:{fence.step_execution_id}"
            kind, _, spec = decl.key.partition(":")
            if kind == "duration":
                seconds = parse_duration(spec)
                if not seconds:
                    raise StepFault("wait_duration_invalid", f"{spec!r} is not a duration")
                return replace(wait, producer_key=key, resume_after_s=seconds, probe_after_s=None)
            instant = parse_instant(_value(spec, env))
            return replace(wait, producer_key=key, resume_at=instant, probe_after_s=None)
        rid = _key_text(_value(decl.key, env))
        if family is ProducerFamily.RECORD_CHANGE:
            if decl.object is None:
                raise InvariantError("a record-change wait without its object")
            return replace(
                wait, producer_key=record_key(decl.object, rid), watch_object=decl.object
            )
        return replace(wait, producer_key=rid)

    def commit_tail(self, wait: PreparedWait) -> CommitTail:
        """Inside the worker's commit, after the ``EnterWait`` transition (§14.2 step 3):
        the dependency with times from the commit's database clock, in the transition's
        round trip where the backend batches writes (ADR 0010: a new row keyed under the
        held root), then a record wait's watch registration."""

        async def writes(_conn: AsyncConnection, now: datetime) -> list[Write]:
            return [dependency_insert(wait.scope, wait.dependency(now), now)]

        async def settle(conn: AsyncConnection, _inserted: bool) -> None:
            if wait.watch_object is not None:
                now = await self._clock(conn)
                await self._watches.watch_txn(conn, wait.scope, wait.watch_object, now)

        return CommitTail(writes, settle)

    async def after_commit(self, wait: PreparedWait) -> None:
        """§14.2 step 4: the required fresh-snapshot reconciliation of the new dependency."""
        crash_point(CrashPoint.AFTER_WAIT_COMMIT, wait.step_key)
        if wait.watch_object is not None:
            # A local write that reloaded the memo before this commit must reload again.
            self._watches.invalidate(wait.scope.org_id)
        await self.matcher.reconcile(wait.scope.org_id, wait.dependency_id)
