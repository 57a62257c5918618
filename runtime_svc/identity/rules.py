"""Pure §17 rules: authorization-context digests and the reauthorization decision.

A run records who initiated it and the digest of that principal's authorization context
when it was admitted (:func:`authorization_context_digest`). Before its business
transaction each durable step decides (:func:`decide`), from the step's declared
:class:`~runtime_svc.compiler.identity.StepPrincipal` and the principal directory's
current state, whether it may act and as whom:

* ``initiating_principal`` mode: the initiating principal must be enabled and its
  authorization context (permission, FLS and RLS grants, as digested by the directory)
  unchanged since admission — a disabled principal is ``principal_disabled``, any other
  change ``permission_changed``;
* ``system`` mode: the explicit declared system identity must be registered and enabled
  (``system_identity_unknown`` / ``system_identity_disabled``); the initiating
  principal's later state does not matter — the step never acted with its authority;
* a denial follows the step's versioned policy: ``fault_path`` (the step's compiled
  fault successor, else terminal failure), ``terminal_failure``, or ``system_handoff``
  (the step runs as its declared system identity when that identity may act, else
  terminal failure).

Runs created before revision ``0012_identity`` carry no identity and are not
reauthorized. Everything here is pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from runtime_svc.compiler.identity import (
    ExecutionPrincipalMode,
    ReauthorizationPolicy,
    StepPrincipal,
)
from runtime_svc.compiler.kinds import StepKind
from runtime_svc.compiler.plan import ExecutionPlan
from services.digest import versioned_digest

__all__ = [
    "Allowed",
    "DenialOutcome",
    "Denied",
    "Handoff",
    "PrincipalState",
    "PrincipalStatus",
    "ReasonCode",
    "RunIdentity",
    "Verdict",
    "authorization_context_digest",
    "decide",
    "permission_digest",
    "reauthorizes",
    "run_principal_mode",
]


class PrincipalStatus(StrEnum):
    """Directory status of a principal."""

    ENABLED = "enabled"
    DISABLED = "disabled"


class ReasonCode(StrEnum):
    """Safe reason codes of a failed reauthorization (history, audit, metrics)."""

    PRINCIPAL_DISABLED = "principal_disabled"
    PERMISSION_CHANGED = "permission_changed"
    SYSTEM_IDENTITY_UNKNOWN = "system_identity_unknown"
    SYSTEM_IDENTITY_DISABLED = "system_identity_disabled"


class DenialOutcome(StrEnum):
    """What a denied step does (the policy applied)."""

    FAULT_PATH = "fault_path"
    TERMINAL_FAILURE = "terminal_failure"


@dataclass(frozen=True)
class PrincipalState:
    """One principal directory row (ids and digests only, never a credential)."""

    principal_id: str
    status: PrincipalStatus
    permission_digest: str


@dataclass(frozen=True)
class RunIdentity:
    """The §17.1 identity a run stores (``None`` fields: a pre-revision run)."""

    initiating_principal_id: str | None
    execution_principal_mode: str | None
    authorization_context_digest: str | None


@dataclass(frozen=True)
class Allowed:
    """The step may act as ``acting_principal_id`` (``None``: not reauthorized)."""

    acting_principal_id: str | None


@dataclass(frozen=True)
class Handoff:
    """A denial handed off to the step's declared system identity (§17.2)."""

    reason: ReasonCode
    acting_principal_id: str


@dataclass(frozen=True)
class Denied:
    """The step must not act: ``outcome`` is the policy applied for ``reason``."""

    reason: ReasonCode
    outcome: DenialOutcome


Verdict = Allowed | Handoff | Denied


def permission_digest(grants: Iterable[str]) -> str:
    """Digest of a principal's permission state (permission, FLS and RLS grant names);
    order and duplicates do not matter."""
    return versioned_digest("principal-permissions", sorted(set(grants)))


def authorization_context_digest(principal_id: str, state: PrincipalState | None) -> str:
    """Digest of ``principal_id``'s authorization context: its permission digest, or the
    fact that the directory does not manage it (``state`` ``None``). The status is not
    part of it: a disabled principal is its own reason."""
    return versioned_digest(
        "authorization-context",
        {
            "principal_id": principal_id,
            "permission_digest": None if state is None else state.permission_digest,
        },
    )


def reauthorizes(kind: StepKind) -> bool:
    """Whether a step of ``kind`` reauthorizes before its transaction.

    Terminal and explicit-fault steps only end the run; a dependency wait only waits (the
    step after it reauthorizes — §22.6 "principal disabled while waiting"); an effect
    completion records the outcome of a submission that was authorized when it acted,
    which must never be lost.
    """
    return kind not in (
        StepKind.TERMINAL,
        StepKind.EXPLICIT_FAULT,
        StepKind.DEPENDENCY_WAIT,
        StepKind.EFFECT_COMPLETION,
    )


def run_principal_mode(plan: ExecutionPlan) -> str:
    """The run's execution-principal mode: the single mode its steps declare, ``mixed``
    when they differ (each step then acts per its own), ``initiating_principal`` for the
    single-transaction profiles (they run inside the initiating call)."""
    modes = {s.principal.mode.value for s in plan.steps if s.principal is not None}
    if not modes:
        return ExecutionPrincipalMode.INITIATING_PRINCIPAL.value
    return modes.pop() if len(modes) == 1 else "mixed"


def _system(declared: StepPrincipal, system: PrincipalState | None) -> ReasonCode | None:
    if declared.system_identity is None or system is None:
        return ReasonCode.SYSTEM_IDENTITY_UNKNOWN
    if system.status is not PrincipalStatus.ENABLED:
        return ReasonCode.SYSTEM_IDENTITY_DISABLED
    return None


def _deny(reason: ReasonCode, policy: ReauthorizationPolicy) -> Denied:
    if policy is ReauthorizationPolicy.FAULT_PATH:
        return Denied(reason, DenialOutcome.FAULT_PATH)
    return Denied(reason, DenialOutcome.TERMINAL_FAILURE)


def decide(
    run: RunIdentity,
    declared: StepPrincipal,
    initiating: PrincipalState | None,
    system: PrincipalState | None,
) -> Verdict:
    """The reauthorization verdict of one durable step (see the module docstring).

    Args:
        run: the identity the run stored at admission.
        declared: the step's compiled principal contract.
        initiating: the directory state of the initiating principal (``None``: not in
            the directory).
        system: the directory state of ``declared.system_identity`` (``None``: not
            declared or not in the directory).
    """
    if declared.mode is ExecutionPrincipalMode.SYSTEM:
        reason = _system(declared, system)
        if reason is None and declared.system_identity is not None:
            return Allowed(declared.system_identity)
        # Already system: a handoff has nowhere to go.
        return _deny(reason or ReasonCode.SYSTEM_IDENTITY_UNKNOWN, declared.on_denied)
    principal = run.initiating_principal_id
    if principal is None or run.authorization_context_digest is None:
        return Allowed(None)  # a run created before identity was recorded
    if initiating is not None and initiating.status is not PrincipalStatus.ENABLED:
        denial = ReasonCode.PRINCIPAL_DISABLED
    elif authorization_context_digest(principal, initiating) != run.authorization_context_digest:
        denial = ReasonCode.PERMISSION_CHANGED
    else:
        return Allowed(principal)
    if declared.on_denied is ReauthorizationPolicy.SYSTEM_HANDOFF:
        if _system(declared, system) is None and declared.system_identity is not None:
            return Handoff(denial, declared.system_identity)
        return Denied(denial, DenialOutcome.TERMINAL_FAILURE)
    return _deny(denial, declared.on_denied)
