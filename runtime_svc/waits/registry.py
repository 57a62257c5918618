"""The wait-producer registry (§14.1): every producer kind a dependency may name, and
what it publishes — identity, existence check, notification, bounded reconciliation,
wake version/token, safe receipt and expiry behaviour.

Four families, each real:

=====================  ======================================================================
family                 contract
=====================  ======================================================================
``runtime.timer``      identity: the waiting step; no signal — the due time is the
                       dependency's durable ``next_probe_at`` (``Deadline``/``RunAfter``, no
                       process timer); reconciliation: the due-time sweep; receipt: the due
                       and observed times; expiry: the compiled deadline.
``record.change``      identity: ``<object>/<record id>``; notification: the record engine
                       writes a signal in the same transaction as the record change (wake
                       version = record version, token ``v<version>``), only for objects an
                       active plan waits on; reconciliation: re-read the record and
                       evaluate the condition (bounded probes); existence check: a deleted
                       record can never match, the compiled expiry policy applies at once;
                       receipt: record version and condition digest.
external signal kinds  identity: the producer key the caller chose; notification:
(configured)           ``SubmitWakeSignal`` by a workload holding ``flow.signals.submit``;
                       reconciliation: durable signal/dependency rematch (bounded); receipt:
                       the consumed signal's id, token, version and evidence digest.
``effect.completion``  identity: the ``EffectHandoffKey``; notification: the owner's
                       producer outbox delivers each completion receipt through
                       ``SubmitWakeSignal`` (token ``<command_id>/<outcome_version>``, wake
                       version = outcome version, evidence = the receipt); reconciliation:
                       durable rematch; the resuming ``EffectCompletion`` step reads the
                       consumed signal's evidence.
=====================  ======================================================================

A plan names the effect family as ``effect.completion:<owner kind>/<owner id>``; every
such name resolves to the one ``effect.completion`` producer. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from runtime_svc.compiler.inputs import RuntimePolicy
from runtime_svc.compiler.kinds import (
    EFFECT_COMPLETION_PRODUCER,
    RECORD_CHANGE_PRODUCER,
    TIMER_PRODUCER,
)
from runtime_svc.compiler.plan import DependencyDecl, ExecutionPlan
from services.auth import SIGNALS_SUBMIT_ROLE

__all__ = [
    "DEFAULT_SIGNAL_KINDS",
    "SIGNAL_SUBMIT_ROLE",
    "ProducerFamily",
    "ProducerIssue",
    "ProducerRegistry",
    "ProducerSpec",
]

#: Role a workload credential needs to call ``SubmitWakeSignal`` (defined once with the
#: other roles in ``services.auth``).
SIGNAL_SUBMIT_ROLE = SIGNALS_SUBMIT_ROLE
#: External signal kinds registered when the configuration names none.
DEFAULT_SIGNAL_KINDS = ("external.signal",)


class ProducerFamily(StrEnum):
    """How a producer kind notifies and is reconciled."""

    TIMER = "timer"
    RECORD_CHANGE = "record_change"
    EXTERNAL = "external"
    EFFECT_COMPLETION = "effect_completion"


@dataclass(frozen=True)
class ProducerSpec:
    """One registered producer kind and its published contract (§14.1).

    Attributes:
        kind: the producer kind stored on dependencies and signals.
        family: its behaviour class.
        identity: how the producer key is formed.
        existence_check: what proves the producer can still fire.
        notification: how a wake reaches the runtime (``""``: none).
        reconciliation: the bounded reconciliation strategy (``""``: none).
        wake_identity: the wake version / token rule.
        receipt: what the resolution receipt records (safe values only).
        expiry: what bounds the wait.
        api_submittable: whether ``SubmitWakeSignal`` accepts this kind.
    """

    kind: str
    family: ProducerFamily
    identity: str
    existence_check: str
    notification: str
    reconciliation: str
    wake_identity: str
    receipt: str
    expiry: str
    api_submittable: bool = False

    @property
    def resolvable(self) -> bool:
        """Whether the producer has a notification or a bounded reconciliation."""
        return bool(self.notification or self.reconciliation)


@dataclass(frozen=True)
class ProducerIssue:
    """An activation diagnostic: a plan step whose dependency producer is unusable."""

    step_key: str
    producer_kind: str
    code: str
    message: str


_TIMER = ProducerSpec(
    kind=TIMER_PRODUCER,
    family=ProducerFamily.TIMER,
    identity="the waiting step execution",
    existence_check="none needed: the runtime's own clock",
    notification="durable due time (dependency next_probe_at); no process timer",
    reconciliation="due-time sweep over the (org, state, next_probe_at) index",
    wake_identity="none (one due time per dependency)",
    receipt="due time and observed time",
    expiry="compiled deadline (≥ the resume time)",
)
_RECORD = ProducerSpec(
    kind=RECORD_CHANGE_PRODUCER,
    family=ProducerFamily.RECORD_CHANGE,
    identity="<object>/<record id>",
    existence_check="the record exists and is not deleted (a deleted record expires the wait)",
    notification="signal written by the record engine in the record's own transaction",
    reconciliation="re-read the record and evaluate the condition (bounded probes)",
    wake_identity="wake version = record version; token v<version>",
    receipt="record version and condition digest",
    expiry="compiled deadline; producer deleted → compiled expiry policy",
)
_EFFECT = ProducerSpec(
    kind=EFFECT_COMPLETION_PRODUCER,
    family=ProducerFamily.EFFECT_COMPLETION,
    identity="EffectHandoffKey of the submit",
    existence_check="the owner's accepted receipt (owner-governed)",
    notification="owner producer outbox → SubmitWakeSignal (acknowledged after commit)",
    reconciliation="durable signal/dependency rematch (bounded probes)",
    wake_identity="wake version = outcome version; token <command_id>/<outcome_version>",
    receipt="consumed signal: command id, outcome version, outcome, evidence digest",
    expiry="maximum wait age of the policy, then the compiled policy",
    api_submittable=True,
)


def _external(kind: str) -> ProducerSpec:
    return ProducerSpec(
        kind=kind,
        family=ProducerFamily.EXTERNAL,
        identity="producer key chosen by the authenticated caller",
        existence_check="none: the deadline bounds the wait",
        notification=f"SubmitWakeSignal (role {SIGNAL_SUBMIT_ROLE})",
        reconciliation="durable signal/dependency rematch (bounded probes)",
        wake_identity="idempotent wake token; optional monotonic wake version",
        receipt="consumed signal id, token, version and evidence digest",
        expiry="compiled deadline",
        api_submittable=True,
    )


class ProducerRegistry:
    """The producer kinds this runtime can resolve: the three built-ins plus the
    configured external signal kinds.

    Args:
        signal_kinds: external signal kinds accepted from ``SubmitWakeSignal``.

    Raises:
        ValueError: an external kind collides with a built-in or is malformed.
    """

    def __init__(self, signal_kinds: Iterable[str] = DEFAULT_SIGNAL_KINDS) -> None:
        builtins = {s.kind: s for s in (_TIMER, _RECORD, _EFFECT)}
        specs = dict(builtins)
        for kind in signal_kinds:
            kind = kind.strip()
            if not kind or len(kind) > 64 or ":" in kind or kind in builtins:
                raise ValueError(f"{kind!r} cannot be an external signal kind")
            specs[kind] = _external(kind)
        self._specs: Mapping[str, ProducerSpec] = specs

    @property
    def kinds(self) -> tuple[str, ...]:
        """Every registered kind, sorted."""
        return tuple(sorted(self._specs))

    def spec(self, kind: str) -> ProducerSpec | None:
        """The spec of a stored producer kind, or ``None`` when it is not registered."""
        return self._specs.get(kind)

    def for_declaration(self, producer_kind: str) -> ProducerSpec | None:
        """The spec a plan's dependency declaration names (the effect family's
        ``effect.completion:<owner>`` names resolve to ``effect.completion``)."""
        family = producer_kind.split(":", 1)[0]
        if family == EFFECT_COMPLETION_PRODUCER:
            return _EFFECT
        return self._specs.get(producer_kind)

    def compiler_producers(self) -> tuple[Mapping[str, str], ...]:
        """The ``wait_producers`` the compiler checks event waits against."""
        return tuple(
            {"kind": s.kind, "reconciliation": "event"}
            for s in sorted(self._specs.values(), key=lambda s: s.kind)
            if s.family is ProducerFamily.EXTERNAL
        )

    def check_plan(self, plan: ExecutionPlan) -> list[ProducerIssue]:
        """Activation check (§10.5, issue 11): every dependency a plan step declares names
        a registered producer that has a notification or a bounded reconciliation."""
        issues: list[ProducerIssue] = []
        for step in plan.steps:
            decl = step.dependency
            if decl is None:
                continue
            spec = self.for_declaration(decl.producer_kind)
            if spec is None:
                issues.append(
                    ProducerIssue(
                        step.key,
                        decl.producer_kind,
                        "wait.producer_not_registered",
                        f"step {step.key}: producer {decl.producer_kind!r} is not registered "
                        "with this runtime; the wait could never be resolved",
                    )
                )
            elif not spec.resolvable:
                issues.append(
                    ProducerIssue(
                        step.key,
                        decl.producer_kind,
                        "wait.producer_unresolvable",
                        f"step {step.key}: producer {decl.producer_kind!r} has neither a "
                        "notification nor a bounded reconciliation",
                    )
                )
        return issues

    def explainer(self, policy: RuntimePolicy | None) -> Callable[[DependencyDecl], Sequence[str]]:
        """The ``explain`` annotation of a dependency: its producer contract and the
        policy bounds that apply (maximum wait age, reconciliation probes)."""

        def lines(decl: DependencyDecl) -> Sequence[str]:
            spec = self.for_declaration(decl.producer_kind)
            if spec is None:
                return [f"producer: {decl.producer_kind} NOT REGISTERED (activation fails)"]
            out = [
                f"producer: {spec.kind} ({spec.family.value}); identity {spec.identity}",
                f"  notification: {spec.notification or 'none'}",
                f"  reconciliation: {spec.reconciliation or 'none'}",
                f"  wake: {spec.wake_identity}; receipt: {spec.receipt}",
            ]
            if decl.object is not None:
                out.append(f"  watches: {decl.object} records (signals only while a plan waits)")
            if policy is not None:
                w = policy.wait_policy
                out.append(
                    f"  bounds: max wait age {policy.max_wait_seconds}s (policy "
                    f"v{policy.version}); ≤ {w.max_reconciliation_attempts} probes, "
                    f"{w.probe_initial_seconds}s doubling to {w.probe_max_seconds}s"
                )
            return out

        return lines
