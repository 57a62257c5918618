"""The ``EffectSubmit`` and ``EffectCompletion`` steps in the worker (§15.1, §15.2).

Both run through the ordinary claim → execute → commit path of the worker; what differs
is what they prepare and what their commit adds.

**EffectSubmit** (:meth:`EffectSteps.prepare` → :class:`PreparedSubmit`):

1. before any transaction, without a lock: the action inputs are evaluated on the
   checkpoint into the frozen payload (:func:`~runtime_svc.effects.model.effect_payload`)
   and every identity is computed from the deterministic ``EffectHandoffKey`` (outbox
   message, completion step, dependency, link — :func:`submit_identities`);
2. the worker's commit transaction locks root → submit step → attempt and applies the
   :class:`~runtime_svc.kernel.decisions.HandOff` advance (attempt ``Committed``, submit
   ``Succeeded``, the completion step inserted ``Waiting``, root ``Waiting`` on it, the
   checkpoint), then its :meth:`EffectSteps.commit_tail` inserts the completion
   dependency, enqueues the ``flow.effect.submit`` message and writes the immutable link
   — in that order, last, inside the same transaction (and the same round trip). No
   remote call happens anywhere in it; the Runtime outbox dispatcher delivers after the
   commit.

**EffectCompletion** (:meth:`EffectSteps.prepare` with no commit extra): once a receipt
resolved its dependency (root-first, §14.2) the step reads the consumed receipt and the
link, validates them (:func:`~runtime_svc.effects.model.validate_receipt`) and routes
(:func:`~runtime_svc.effects.model.route_completion`): the success edge (its output
variable receives the owner's command id), the compiled fault path, terminal failure, or
quarantine. A receipt or link that does not validate quarantines. This path holds no
reference to the outbox: a crash, a duplicate wake, lease recovery or a retry of the
completion step can re-read the receipt; it can never enqueue another submit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from runtime_svc.compiler import ExpressionEvalError, evaluate, parse_expression
from runtime_svc.compiler.expressions import ExpressionError
from runtime_svc.compiler.kinds import (
    EFFECT_COMPLETION_PRODUCER,
    EdgeKind,
    ExpiryPolicy,
    QueueClass,
    StepKind,
)
from runtime_svc.compiler.plan import ExecutionPlan, PlanStep
from runtime_svc.effects.links import insert_link_txn, link_by_key_txn, link_insert
from runtime_svc.effects.model import (
    ConsumedReceipt,
    LinkRecord,
    PayloadError,
    ReceiptInvalid,
    Route,
    SubmitIdentities,
    effect_payload,
    route_completion,
    submit_identities,
    validate_receipt,
)
from runtime_svc.kernel.decisions import Advance, FailRun, HandOff, QuarantineRun
from runtime_svc.kernel.model import LeaseFence
from runtime_svc.kernel.store import CommitTail
from runtime_svc.kernel.store_waits import dependency_insert
from runtime_svc.kernel.transitions_effects import CAUSE_EFFECT_RECEIPT_INVALID
from runtime_svc.kernel.wait_model import ExpiryPolicyCode, WorkScopeKey
from runtime_svc.outbox import RUNTIME_OUTBOX, EffectSubmitIntent, effect_submit_intent
from runtime_svc.outbox import preclaim as outbox_preclaim
from runtime_svc.waits.resolution import Clock
from runtime_svc.waits.steps import PreparedWait, WaitSteps
from runtime_svc.waits.support import consumed_signal_txn
from runtime_svc.worker.executor import (
    StepFault,
    StepOutcome,
    advance_to,
    context_of,
    env_of,
    to_json_value,
)
from services.auth import TrustedRuntimeWorkScope
from services.db import db_now, transaction
from services.db_batch import Write
from services.effect_contract import FLOW_EFFECT_SUBMIT_FAMILY, EffectContractError
from services.invariants import InvariantError
from services.outbox import (
    OutboxHint,
    OutboxMessage,
    PendingEnqueue,
    enqueue_settle,
    enqueue_write,
    hint_of,
)

__all__ = ["EffectSteps", "PreparedSubmit"]

log = logging.getLogger(__name__)

_EXPIRY = {
    ExpiryPolicy.FAULT_PATH: ExpiryPolicyCode.FAULT_PATH,
    ExpiryPolicy.TERMINAL_FAILURE: ExpiryPolicyCode.TERMINAL_FAILURE,
    ExpiryPolicy.QUARANTINE: ExpiryPolicyCode.QUARANTINE,
}


@dataclass(frozen=True)
class PreparedSubmit:
    """Everything an ``EffectSubmit`` commit writes after its ``HandOff`` transition,
    computed before the transaction (the deadline is set from the commit's clock)."""

    identities: SubmitIdentities
    intent: EffectSubmitIntent
    wait: PreparedWait
    link: LinkRecord
    step_key: str
    #: Set by the commit transaction: its outbox message when it was enqueued leased to
    #: this process's dispatcher (ADR 0004), to hand over after the commit.
    leased: list[OutboxMessage] = field(default_factory=list, compare=False, repr=False)


def _work(scope: TrustedRuntimeWorkScope) -> WorkScopeKey:
    return WorkScopeKey(
        scope.org_id,
        scope.app_installation_id,
        scope.runtime_capability_id,
        scope.runtime_work_binding_digest,
    )


def _element(plan: ExecutionPlan, step: PlanStep) -> Mapping[str, Any]:
    for node in plan.nodes:
        if node.id == step.entry and node.element is not None:
            return node.element
    raise StepFault("plan_node_missing", step.entry)


def _evaluate(text: Any, env: Mapping[str, Any]) -> Any:
    if not isinstance(text, str):
        return text
    try:
        return to_json_value(evaluate(parse_expression(text), env))
    except (ExpressionError, ExpressionEvalError) as exc:
        raise StepFault("expression_error", str(exc)) from exc


def _edge(step: PlanStep, kind: EdgeKind, label: str | None = None) -> str | None:
    for t in step.transitions:
        if t.source == step.entry and t.kind is kind and (label is None or t.label == label):
            return t.target
    return None


class EffectSteps:
    """Prepare and commit ``EffectSubmit`` / ``EffectCompletion`` steps (see the module
    docstring).

    Args:
        engine: the runtime database.
        waits: the wait steps (the completion dependency is a durable wait: inserted,
            reconciled and probed like every other).
        clock: the durable clock (the worker's store clock).
        on_submitted: called after a submit committed with the hint naming its outbox
            message (wakes the outbox dispatcher, which claims that message directly).
    """

    def __init__(
        self,
        engine: AsyncEngine,
        waits: WaitSteps,
        clock: Clock,
        *,
        on_submitted: Callable[[OutboxHint], None] | None = None,
    ) -> None:
        self._engine = engine
        self._waits = waits
        self._clock = clock
        self._on_submitted = on_submitted

    async def prepare(
        self,
        org_id: str,
        fence: LeaseFence,
        scope: TrustedRuntimeWorkScope,
        plan: ExecutionPlan,
        policy_version: int,
        step: PlanStep,
        context: Mapping[str, Any],
        invocation_ordinal: int,
    ) -> tuple[StepOutcome, PreparedSubmit | None]:
        """The step's outcome, and for a submit what its commit adds.

        Raises:
            StepFault: a malformed plan step or payload (the submit fails terminally
                before anything left the runtime).
        """
        if step.effect is None:
            raise StepFault("effect_step_without_effect", f"{step.key} declares no effect")
        if step.kind is StepKind.EFFECT_SUBMIT:
            return await self._submit(
                org_id, fence, scope, plan, policy_version, step, context, invocation_ordinal
            )
        if step.kind is StepKind.EFFECT_COMPLETION:
            outcome = await self._completion(
                org_id, fence, scope, plan, step, context, invocation_ordinal
            )
            return outcome, None
        raise StepFault("unsupported_step_kind", f"{step.kind.value} is not an effect step")

    # --- submit --------------------------------------------------------------------------

    async def _submit(
        self,
        org_id: str,
        fence: LeaseFence,
        scope: TrustedRuntimeWorkScope,
        plan: ExecutionPlan,
        policy_version: int,
        step: PlanStep,
        context: Mapping[str, Any],
        ordinal: int,
    ) -> tuple[StepOutcome, PreparedSubmit]:
        effect = step.effect
        if effect is None:
            raise InvariantError(f"step {step.key} is not an effect step")
        try:
            completion = plan.step(effect.completion_step)
        except (KeyError, LookupError):
            raise StepFault("plan_target_missing", effect.completion_step) from None
        decl = completion.dependency
        if decl is None or completion.kind is not StepKind.EFFECT_COMPLETION:
            raise StepFault("effect_completion_missing", f"{completion.key} is no completion")
        owner_kind = effect.owner_id or ""
        env = env_of(context)
        for var in plan.variables:
            env.setdefault(var.name, [] if var.type.startswith("list<") else None)
        element = _element(plan, step)
        inputs = {str(k): _evaluate(v, env) for k, v in (element.get("inputs") or {}).items()}
        try:
            payload = effect_payload(inputs)
            ids = submit_identities(
                scope,
                flow_run_id=fence.flow_run_id,
                submit_step_key=step.key,
                invocation_ordinal=ordinal,
            )
            intent = effect_submit_intent(
                scope,
                flow_run_id=fence.flow_run_id,
                submit_step_key=step.key,
                invocation_ordinal=ordinal,
                step_execution_id=fence.step_execution_id,
                submission_attempt_id=fence.attempt_id,
                effect_owner_kind=owner_kind,
                payload=payload,
                deadline=None,
                failure_policy=decl.expiry_policy.value,
            )
        except PayloadError as exc:
            raise StepFault(exc.code, str(exc)) from None
        except EffectContractError as exc:
            raise StepFault("effect_contract_invalid", str(exc)) from None
        bounds = await self._waits.matcher.plans.bounds(self._engine, org_id, policy_version)
        max_wait = bounds.max_wait_seconds
        wait = PreparedWait(
            scope=_work(scope),
            dependency_id=ids.dependency_id,
            flow_run_id=fence.flow_run_id,
            step_execution_id=ids.completion_step_id,
            step_key=completion.key,
            producer_kind=EFFECT_COMPLETION_PRODUCER,
            producer_key=ids.handoff_key,
            condition_digest=decl.condition_digest,
            expiry_policy=_EXPIRY[decl.expiry_policy],
            deadline_after_s=min(decl.deadline_seconds or max_wait, max_wait),
            probe_after_s=bounds.policy.probe_initial_seconds,
        )
        link = LinkRecord(
            org_id=scope.org_id,
            app_installation_id=scope.app_installation_id,
            runtime_capability_id=scope.runtime_capability_id,
            runtime_work_binding_digest=scope.runtime_work_binding_digest,
            effect_link_id=ids.link_id,
            flow_run_id=fence.flow_run_id,
            step_execution_id=fence.step_execution_id,
            effect_owner_kind=owner_kind,
            runtime_outbox_message_id=ids.message_id,
            effect_handoff_key=ids.handoff_key,
            submission_attempt_id=fence.attempt_id,
        )
        queue = (completion.queue_class or QueueClass.EFFECT_COMPLETION).value
        advance = HandOff(
            step_execution_id=ids.completion_step_id,
            plan_step_key=completion.key,
            step_kind=completion.kind.value,
            queue_class=queue,
            invocation_ordinal=ordinal,
        )
        prepared = PreparedSubmit(ids, intent, wait, link, step.key)
        return StepOutcome(context_of(env, context), (), advance), prepared

    def commit_tail(self, prepared: PreparedSubmit) -> CommitTail:
        """The submit's rows in its commit transaction, after its root → step → attempt
        transition (§15.1 steps 3-4): the completion dependency, then the outbox message
        (the enqueue API locks nothing before its insert), then the immutable link — in
        the transition's round trip where the backend batches writes (ADR 0010: new rows
        keyed under the held root; the link follows only a new message)."""
        pending: list[PendingEnqueue] = []

        async def writes(conn: AsyncConnection, now: datetime) -> list[Write]:
            dependency = prepared.wait.dependency(now)
            # The handoff converges by the same instant the dependency expires (§15.4).
            intent = replace(prepared.intent, deadline=dependency.deadline)
            # The outbox's own times (created, due) come from the database clock its
            # dispatcher reads (the transaction's reading: no statement for it); the
            # deadline is the dependency's. A process whose outbox dispatcher runs writes
            # the message already leased to it and hands it over after the commit: no
            # claim transaction before AcceptHandoff.
            dispatcher = outbox_preclaim.dispatcher_for(self._engine)
            lease = None if dispatcher is None else dispatcher.preclaim(FLOW_EFFECT_SUBMIT_FAMILY)
            message = enqueue_write(
                RUNTIME_OUTBOX, intent.message(), now=await db_now(conn), preclaim=lease
            )
            pending[:] = [message]
            return [
                dependency_insert(prepared.wait.scope, dependency, now),
                message.write,
                link_insert(prepared.link, now),
            ]

        async def settle(conn: AsyncConnection, inserted: bool) -> None:
            enqueued = await enqueue_settle(conn, pending[0], inserted)
            prepared.leased.clear()  # a retried transaction starts over
            if enqueued.leased is not None:
                prepared.leased.append(enqueued.leased)
            if not enqueued.created:  # the message was there: the link was not written
                now = await self._clock(conn)
                await insert_link_txn(conn, prepared.link, now)

        return CommitTail(writes, settle)

    async def after_commit(self, prepared: PreparedSubmit) -> None:
        """Wake this process's outbox dispatcher with the committed message, then the
        completion dependency's fresh reconciliation (§14.2 step 4): a receipt that
        committed first is matched now instead of at the next probe."""
        dispatcher = outbox_preclaim.dispatcher_for(self._engine)
        if prepared.leased and dispatcher is not None:
            dispatcher.hand(prepared.leased[0])
        elif self._on_submitted is not None:
            self._on_submitted(hint_of(RUNTIME_OUTBOX, prepared.intent.message()))
        await self._waits.after_commit(prepared.wait)

    # --- completion ----------------------------------------------------------------------

    async def _completion(
        self,
        org_id: str,
        fence: LeaseFence,
        scope: TrustedRuntimeWorkScope,
        plan: ExecutionPlan,
        step: PlanStep,
        context: Mapping[str, Any],
        ordinal: int,
    ) -> StepOutcome:
        effect = step.effect
        if effect is None:
            raise InvariantError(f"step {step.key} is not an effect step")
        env = env_of(context)
        for var in plan.variables:
            env.setdefault(var.name, [] if var.type.startswith("list<") else None)
        try:
            key = submit_identities(
                scope,
                flow_run_id=fence.flow_run_id,
                submit_step_key=effect.submit_step,
                invocation_ordinal=ordinal,
            ).handoff_key
        except EffectContractError as exc:
            raise StepFault("effect_contract_invalid", str(exc)) from None
        async with transaction(self._engine, readonly=True) as conn:
            found = await consumed_signal_txn(conn, org_id, fence.step_execution_id)
            link = await link_by_key_txn(conn, _work(scope), key)
        advance = self._route(plan, step, env, found, link, key, fence.flow_run_id)
        return StepOutcome(context_of(env, context), (), advance)

    def _route(
        self,
        plan: ExecutionPlan,
        step: PlanStep,
        env: dict[str, Any],
        found: Any,
        link: LinkRecord | None,
        key: str,
        flow_run_id: str,
    ) -> Advance:
        effect, decl = step.effect, step.dependency
        if effect is None:
            raise InvariantError(f"step {step.key} is not an effect step")
        if found is None or found[1] is None or decl is None:
            log.warning("effect completion %s has no consumed receipt; quarantining", step.key)
            return QuarantineRun(CAUSE_EFFECT_RECEIPT_INVALID)
        dep, signal = found
        receipt = ConsumedReceipt(
            producer_kind=signal.producer_kind,
            producer_key=signal.producer_key,
            wake_token=signal.wake_token,
            wake_version=signal.wake_version,
            evidence_digest=signal.evidence_digest,
            evidence_json=signal.evidence_json,
            dependency_wake_version=dep.wake_version,
        )
        try:
            evidence = validate_receipt(
                receipt,
                link,
                producer_kind=EFFECT_COMPLETION_PRODUCER,
                handoff_key=key,
                owner_kind=effect.owner_id or "",
                flow_run_id=flow_run_id,
            )
        except ReceiptInvalid as exc:
            log.warning("effect completion %s: %s (%s); quarantining", step.key, exc.code, exc)
            return QuarantineRun(CAUSE_EFFECT_RECEIPT_INVALID)
        handled = _edge(step, EdgeKind.FAULT, "fault")
        decision = route_completion(
            evidence.outcome, _EXPIRY[decl.expiry_policy], has_fault_path=handled is not None
        )
        match decision.route:
            case Route.SUCCESS:
                out = _element(plan, step).get("output_variable")
                if out:
                    env[str(out)] = evidence.command_id
                target = _edge(step, EdgeKind.SUCCESS) or _edge(step, EdgeKind.TERMINAL)
                return advance_to(plan, target, None, env)
            case Route.FAULT_PATH:
                return advance_to(plan, handled, decision.code, env)
            case Route.TERMINAL_FAILURE:
                target = _edge(step, EdgeKind.FAULT)
                if target is None:
                    return FailRun(decision.code)
                return advance_to(plan, target, decision.code, env)
        return QuarantineRun(decision.code)
