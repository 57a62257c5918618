"""When does a runtime handler *broaden* the capability its owner declared? (§8.3, §8.4)

A handler binding may carry the descriptor its implementation asserts
(``HandlerBinding.asserted_capability``). The plan is compiled against the owner's
declared descriptor, so the handler must fit inside it: it **broadens** the declaration
when a plan compiled against the declared descriptor could observe behaviour from the
handler that the declaration does not permit. Per field (``a`` asserted, ``d`` declared):

=========================  ==============================================================
Field                      ``a`` broadens ``d`` when …
=========================  ==============================================================
execution_class            ``a`` is not ``d`` and not below it on PURE_COMPUTE <
                           RECORD_READ < RECORD_MUTATION (PURE_COMPUTE fits any class)
transaction_policy         the transaction shapes ``a`` may use are not a subset of ``d``'s
                           (CALLER={caller}, OWNED={owned}, FORBIDDEN={none},
                           PROFILE_DEPENDENT={caller, owned})
replay_policy              ``a`` is less replay-safe: DETERMINISTIC_REPLAY >
                           IDEMPOTENT_BY_KEY > AT_MOST_ONCE > NOT_REPLAYABLE
fanout_bound               ``d`` is UNKNOWN: never; ``d`` static m: ``a`` is not static
                           or exceeds m; ``d`` metadata-derived: ``a`` is UNKNOWN,
                           static, or derived from another path
read_contract              ``a`` is not ``d`` and not CHECKPOINT_ONLY
lock_plan_contract         kind wider on STATIC_KEYS < METADATA_DERIVED_KEYS <
                           LATE_DISCOVERY_ALLOWED < UNKNOWN; or (``d`` not UNKNOWN) a
                           resource class outside ``d``'s; or more keys than ``d``'s
                           ``max_keys``; or (both static) a static key ``d`` lacks
effect_owner               any difference (the outcome owner is an identity)
idempotency_policy         a different ``key_required`` or ``key_shape`` (the runtime
                           computes exactly the declared key), or a narrower scope on
                           STEP_INVOCATION < FLOW_RUN < RUNTIME_WORK_SCOPE < ORG
output_durability          less durable: EPHEMERAL < CHECKPOINTED < OWNER_RECEIPT
security_policy            more authority: CALLER < INITIATING_PRINCIPAL < SYSTEM; or a
                           more permissive reauthorization outcome: TERMINAL_FAILURE <
                           FAULT_PATH < SYSTEM_HANDOFF
minimum_capability_version ``a`` requires a newer capability generation than ``d``
=========================  ==============================================================
"""

from __future__ import annotations

from .capability import CapabilityDescriptor
from .capability_types import (
    ExecutionClass,
    FanoutBound,
    FanoutBoundKind,
    IdempotencyScope,
    LockPlanContract,
    LockPlanKind,
    OutputDurability,
    PrincipalMode,
    ReadContract,
    ReauthorizationPolicy,
    ReplayPolicy,
    TransactionPolicy,
)
from .diagnostics import Diagnostic, DiagnosticCode

__all__ = ["broadened_fields"]

_EXEC_CHAIN = (
    ExecutionClass.PURE_COMPUTE,
    ExecutionClass.RECORD_READ,
    ExecutionClass.RECORD_MUTATION,
)
_TXN_SHAPES: dict[TransactionPolicy, frozenset[str]] = {
    TransactionPolicy.CALLER_TRANSACTION: frozenset({"caller"}),
    TransactionPolicy.OWNED_TRANSACTION: frozenset({"owned"}),
    TransactionPolicy.TRANSACTION_FORBIDDEN: frozenset({"none"}),
    TransactionPolicy.PROFILE_DEPENDENT: frozenset({"caller", "owned"}),
}
_REPLAY_SAFETY = {
    ReplayPolicy.NOT_REPLAYABLE: 0,
    ReplayPolicy.AT_MOST_ONCE: 1,
    ReplayPolicy.IDEMPOTENT_BY_KEY: 2,
    ReplayPolicy.DETERMINISTIC_REPLAY: 3,
}
_LOCK_WIDTH = {
    LockPlanKind.STATIC_KEYS: 0,
    LockPlanKind.METADATA_DERIVED_KEYS: 1,
    LockPlanKind.LATE_DISCOVERY_ALLOWED: 2,
    LockPlanKind.UNKNOWN: 3,
}
_SCOPE_WIDTH = {
    IdempotencyScope.UNSPECIFIED: 0,
    IdempotencyScope.STEP_INVOCATION: 1,
    IdempotencyScope.FLOW_RUN: 2,
    IdempotencyScope.RUNTIME_WORK_SCOPE: 3,
    IdempotencyScope.ORG: 4,
}
_DURABILITY = {
    OutputDurability.EPHEMERAL: 0,
    OutputDurability.CHECKPOINTED: 1,
    OutputDurability.OWNER_RECEIPT: 2,
}
_AUTHORITY = {
    PrincipalMode.CALLER: 0,
    PrincipalMode.INITIATING_PRINCIPAL: 1,
    PrincipalMode.SYSTEM: 2,
}
_REAUTH_PERMISSIVENESS = {
    ReauthorizationPolicy.TERMINAL_FAILURE: 0,
    ReauthorizationPolicy.FAULT_PATH: 1,
    ReauthorizationPolicy.SYSTEM_HANDOFF: 2,
}


def _name(value: object) -> str:
    return getattr(value, "name", str(value)).lower()


def _exec_within(a: ExecutionClass, d: ExecutionClass) -> bool:
    if a is d or a is ExecutionClass.PURE_COMPUTE:
        return True
    return a in _EXEC_CHAIN and d in _EXEC_CHAIN and _EXEC_CHAIN.index(a) <= _EXEC_CHAIN.index(d)


def _fanout_within(a: FanoutBound, d: FanoutBound) -> bool:
    if d.kind is FanoutBoundKind.UNKNOWN:
        return True
    if d.kind is FanoutBoundKind.STATIC_MAXIMUM:
        return (
            a.kind is FanoutBoundKind.STATIC_MAXIMUM
            and a.static_maximum is not None
            and d.static_maximum is not None
            and a.static_maximum <= d.static_maximum
        )
    return a.kind is FanoutBoundKind.METADATA_DERIVED_MAXIMUM and a.metadata_path == d.metadata_path


def _lock_plan_issues(a: LockPlanContract, d: LockPlanContract, out: list[Diagnostic]) -> None:
    base = "lock_plan_contract"
    if _LOCK_WIDTH[a.kind] > _LOCK_WIDTH[d.kind]:
        out.append(_broad(f"{base}.kind", a.kind, d.kind))
    if d.kind is LockPlanKind.UNKNOWN:
        return
    extra = sorted(set(a.resource_classes) - set(d.resource_classes))
    if extra:
        out.append(
            Diagnostic(
                f"{base}.resource_classes",
                DiagnosticCode.CAPABILITY_BROADENED,
                f"handler may lock classes {extra} outside the declared "
                f"{sorted(d.resource_classes)}",
            )
        )
    if d.max_keys is not None and (a.max_keys is None or a.max_keys > d.max_keys):
        out.append(_broad(f"{base}.max_keys", a.max_keys, d.max_keys))
    both_static = a.kind is LockPlanKind.STATIC_KEYS and d.kind is LockPlanKind.STATIC_KEYS
    if both_static and not set(a.static_keys) <= set(d.static_keys):
        out.append(
            Diagnostic(
                f"{base}.static_keys",
                DiagnosticCode.CAPABILITY_BROADENED,
                "handler declares static keys the owner did not declare",
            )
        )


def _broad(path: str, asserted: object, declared: object) -> Diagnostic:
    return Diagnostic(
        path,
        DiagnosticCode.CAPABILITY_BROADENED,
        f"handler asserts {_name(asserted)}, which broadens the owner's declared {_name(declared)}",
    )


def broadened_fields(
    declared: CapabilityDescriptor, asserted: CapabilityDescriptor
) -> list[Diagnostic]:
    """Every field on which ``asserted`` broadens ``declared`` (both must be valid).

    Returns:
        One ``capability_broadened`` diagnostic per broadened field, its path relative to
        the descriptor (e.g. ``replay_policy``, ``lock_plan_contract.max_keys``).
    """
    d, a = declared, asserted
    out: list[Diagnostic] = []
    if not _exec_within(a.execution_class, d.execution_class):
        out.append(_broad("execution_class", a.execution_class, d.execution_class))
    if not _TXN_SHAPES[a.transaction_policy] <= _TXN_SHAPES[d.transaction_policy]:
        out.append(_broad("transaction_policy", a.transaction_policy, d.transaction_policy))
    if _REPLAY_SAFETY[a.replay_policy] < _REPLAY_SAFETY[d.replay_policy]:
        out.append(_broad("replay_policy", a.replay_policy, d.replay_policy))
    if not _fanout_within(a.fanout_bound, d.fanout_bound):
        out.append(
            Diagnostic(
                "fanout_bound",
                DiagnosticCode.CAPABILITY_BROADENED,
                f"handler fan-out {_fanout_text(a.fanout_bound)} exceeds declared "
                f"{_fanout_text(d.fanout_bound)}",
            )
        )
    if (
        a.read_contract is not d.read_contract
        and a.read_contract is not ReadContract.CHECKPOINT_ONLY
    ):
        out.append(_broad("read_contract", a.read_contract, d.read_contract))
    _lock_plan_issues(a.lock_plan_contract, d.lock_plan_contract, out)
    if a.effect_owner != d.effect_owner:
        out.append(
            Diagnostic(
                "effect_owner",
                DiagnosticCode.CAPABILITY_BROADENED,
                "handler routes its effect to a different owner than the declared one",
            )
        )
    ai, di = a.idempotency_policy, d.idempotency_policy
    if ai.key_required != di.key_required or ai.key_shape != di.key_shape:
        out.append(
            Diagnostic(
                "idempotency_policy.key_shape",
                DiagnosticCode.CAPABILITY_BROADENED,
                f"handler key {ai.key_shape!r} differs from the declared key {di.key_shape!r}",
            )
        )
    if _SCOPE_WIDTH[ai.uniqueness_scope] < _SCOPE_WIDTH[di.uniqueness_scope]:
        out.append(
            _broad("idempotency_policy.uniqueness_scope", ai.uniqueness_scope, di.uniqueness_scope)
        )
    if _DURABILITY[a.output_durability] < _DURABILITY[d.output_durability]:
        out.append(_broad("output_durability", a.output_durability, d.output_durability))
    asp, dsp = a.security_policy, d.security_policy
    if _AUTHORITY[asp.principal_mode] > _AUTHORITY[dsp.principal_mode]:
        out.append(_broad("security_policy.principal_mode", asp.principal_mode, dsp.principal_mode))
    if (
        _REAUTH_PERMISSIVENESS[asp.reauthorization_policy]
        > _REAUTH_PERMISSIVENESS[dsp.reauthorization_policy]
    ):
        out.append(
            _broad(
                "security_policy.reauthorization_policy",
                asp.reauthorization_policy,
                dsp.reauthorization_policy,
            )
        )
    if a.minimum_capability_version > d.minimum_capability_version:
        out.append(
            Diagnostic(
                "minimum_capability_version",
                DiagnosticCode.CAPABILITY_BROADENED,
                f"handler needs capability version {a.minimum_capability_version} > declared "
                f"{d.minimum_capability_version}",
            )
        )
    return out


def _fanout_text(fb: FanoutBound) -> str:
    if fb.kind is FanoutBoundKind.STATIC_MAXIMUM:
        return f"static {fb.static_maximum}"
    if fb.kind is FanoutBoundKind.METADATA_DERIVED_MAXIMUM:
        return f"derived from {fb.metadata_path}"
    return "unknown"
