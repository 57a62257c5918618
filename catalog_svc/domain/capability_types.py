"""Enums and value types of the §8.4 capability descriptor, with their JSON readers.

Enum numbers mirror the proto; ``UNSPECIFIED = 0`` means "missing" (never valid), except
for :class:`IdempotencyScope` where it means "no key required". Field rules live on
:class:`~catalog_svc.domain.capability.CapabilityDescriptor`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import IntEnum

from . import _parse as p
from .diagnostics import Diagnostic, DiagnosticCode

__all__ = [
    "EffectOwnerClass",
    "EffectOwnerContract",
    "ExecutionClass",
    "FanoutBound",
    "FanoutBoundKind",
    "IdempotencyPolicy",
    "IdempotencyScope",
    "LockPlanContract",
    "LockPlanKind",
    "OutputDurability",
    "PrincipalMode",
    "ReadContract",
    "ReauthorizationPolicy",
    "ReplayPolicy",
    "SecurityPolicy",
    "StaticResourceKey",
    "TransactionPolicy",
    "read_effect_owner",
    "read_fanout_bound",
    "read_idempotency_policy",
    "read_lock_plan_contract",
    "read_security_policy",
]


class ExecutionClass(IntEnum):
    """Pure compute, record read, record mutation, wait, or external effect."""

    UNSPECIFIED = 0
    PURE_COMPUTE = 1
    RECORD_READ = 2
    RECORD_MUTATION = 3
    WAIT = 4
    EXTERNAL_EFFECT = 5


class TransactionPolicy(IntEnum):
    """Caller transaction, owned transaction, transaction forbidden, or profile-dependent."""

    UNSPECIFIED = 0
    CALLER_TRANSACTION = 1
    OWNED_TRANSACTION = 2
    TRANSACTION_FORBIDDEN = 3
    PROFILE_DEPENDENT = 4


class ReplayPolicy(IntEnum):
    """Deterministic replay, idempotent by key, at-most-once, or not replayable."""

    UNSPECIFIED = 0
    DETERMINISTIC_REPLAY = 1
    IDEMPOTENT_BY_KEY = 2
    AT_MOST_ONCE = 3
    NOT_REPLAYABLE = 4


class FanoutBoundKind(IntEnum):
    """Static maximum, metadata-derived maximum, or unknown."""

    UNSPECIFIED = 0
    STATIC_MAXIMUM = 1
    METADATA_DERIVED_MAXIMUM = 2
    UNKNOWN = 3


class ReadContract(IntEnum):
    """Checkpoint-only, current transactional read, or verified snapshot."""

    UNSPECIFIED = 0
    CHECKPOINT_ONLY = 1
    CURRENT_TRANSACTIONAL = 2
    VERIFIED_SNAPSHOT = 3


class LockPlanKind(IntEnum):
    """Static resource keys, metadata-derived keys, late-discovery allowed, or unknown."""

    UNSPECIFIED = 0
    STATIC_KEYS = 1
    METADATA_DERIVED_KEYS = 2
    LATE_DISCOVERY_ALLOWED = 3
    UNKNOWN = 4


class EffectOwnerClass(IntEnum):
    """None, integration work, runtime delivery, or another registered owner."""

    UNSPECIFIED = 0
    NONE = 1
    INTEGRATION_WORK = 2
    RUNTIME_DELIVERY = 3
    REGISTERED_OWNER = 4


class IdempotencyScope(IntEnum):
    """Where an idempotency key must be unique; ``UNSPECIFIED`` = no key required."""

    UNSPECIFIED = 0
    STEP_INVOCATION = 1
    FLOW_RUN = 2
    RUNTIME_WORK_SCOPE = 3
    ORG = 4


class OutputDurability(IntEnum):
    """Ephemeral, checkpointed, or owner receipt."""

    UNSPECIFIED = 0
    EPHEMERAL = 1
    CHECKPOINTED = 2
    OWNER_RECEIPT = 3


class PrincipalMode(IntEnum):
    """Execution-principal mode (§17.1, §17.2)."""

    UNSPECIFIED = 0
    CALLER = 1
    INITIATING_PRINCIPAL = 2
    SYSTEM = 3


class ReauthorizationPolicy(IntEnum):
    """What happens when the principal is disabled or its permissions changed (§17.2)."""

    UNSPECIFIED = 0
    FAULT_PATH = 1
    TERMINAL_FAILURE = 2
    SYSTEM_HANDOFF = 3


@dataclass(frozen=True, slots=True)
class FanoutBound:
    """``static_maximum`` (1..2^63-1) iff STATIC_MAXIMUM; ``metadata_path`` iff METADATA_DERIVED."""

    kind: FanoutBoundKind
    static_maximum: int | None = None
    metadata_path: str | None = None


@dataclass(frozen=True, slots=True, order=True)
class StaticResourceKey:
    """A statically declared resource key (§13.2); ``resource_class`` must be declared."""

    resource_class: str
    namespace: str
    record_identity: str | None = None
    partition: str | None = None
    ordering_version: int = 1


@dataclass(frozen=True, slots=True)
class LockPlanContract:
    """Lock-plan contract (§8.4, §13.3).

    ``static_keys`` only for STATIC_KEYS; ``resource_classes`` (a set) required for
    METADATA_DERIVED_KEYS and LATE_DISCOVERY_ALLOWED and must cover every static key;
    ``max_keys`` (>= 1) required for LATE_DISCOVERY_ALLOWED — the bound late discovery may
    not exceed. UNKNOWN carries nothing else.
    """

    kind: LockPlanKind
    static_keys: tuple[StaticResourceKey, ...] = ()
    resource_classes: tuple[str, ...] = ()
    max_keys: int | None = None


@dataclass(frozen=True, slots=True)
class EffectOwnerContract:
    """Owner of the action's effect outcome; ``effect_owner_kind`` names the trusted
    destination capability (never a URL) and is required unless ``owner_class`` is NONE."""

    owner_class: EffectOwnerClass
    effect_owner_kind: str | None = None


@dataclass(frozen=True, slots=True)
class IdempotencyPolicy:
    """Required key shape and uniqueness scope.

    ``key_required`` iff ``key_shape`` is set iff ``uniqueness_scope`` is not UNSPECIFIED.
    """

    key_required: bool = False
    key_shape: str | None = None
    uniqueness_scope: IdempotencyScope = IdempotencyScope.UNSPECIFIED


@dataclass(frozen=True, slots=True)
class SecurityPolicy:
    """Required principal mode and reauthorization behaviour."""

    principal_mode: PrincipalMode
    reauthorization_policy: ReauthorizationPolicy


# -- JSON readers ------------------------------------------------------------------------


def read_fanout_bound(
    m: Mapping[str, object], path: str, issues: list[Diagnostic]
) -> FanoutBound | None:
    p.reject_unknown_keys(m, frozenset({"kind", "static_maximum", "metadata_path"}), path, issues)
    kind = p.get_enum(m, "kind", FanoutBoundKind, path, issues)
    maximum = p.get_int(m, "static_maximum", path, issues, required=False)
    mpath = p.get_str(m, "metadata_path", path, issues, required=False)
    return None if kind is None else FanoutBound(kind, maximum, mpath)


_KEY_FIELDS = frozenset(
    {"resource_class", "namespace", "record_identity", "partition", "ordering_version"}
)


def _read_static_key(
    m: Mapping[str, object], path: str, issues: list[Diagnostic]
) -> StaticResourceKey | None:
    p.reject_unknown_keys(m, _KEY_FIELDS, path, issues)
    rc = p.get_str(m, "resource_class", path, issues, required=True)
    ns = p.get_str(m, "namespace", path, issues, required=True)
    rid = p.get_str(m, "record_identity", path, issues, required=False)
    part = p.get_str(m, "partition", path, issues, required=False)
    ov = p.get_int(m, "ordering_version", path, issues, required=True)
    if rc is None or ns is None or ov is None:
        return None
    return StaticResourceKey(rc, ns, rid, part, ov)


def read_lock_plan_contract(
    m: Mapping[str, object], path: str, issues: list[Diagnostic]
) -> LockPlanContract | None:
    p.reject_unknown_keys(
        m, frozenset({"kind", "static_keys", "resource_classes", "max_keys"}), path, issues
    )
    kind = p.get_enum(m, "kind", LockPlanKind, path, issues)
    keys: list[StaticResourceKey] = []
    for i, raw in enumerate(p.get_list(m, "static_keys", path, issues)):
        kp = p.index(p.at(path, "static_keys"), i)
        sub = p.expect_mapping(raw, kp, issues)
        key = None if sub is None else _read_static_key(sub, kp, issues)
        if key is not None:
            keys.append(key)
    classes: list[str] = []
    for i, raw in enumerate(p.get_list(m, "resource_classes", path, issues)):
        if isinstance(raw, str):
            classes.append(raw)
        else:
            cp = p.index(p.at(path, "resource_classes"), i)
            issues.append(
                Diagnostic(cp, DiagnosticCode.INVALID_TYPE, "resource class must be a string")
            )
    max_keys = p.get_int(m, "max_keys", path, issues, required=False)
    return None if kind is None else LockPlanContract(kind, tuple(keys), tuple(classes), max_keys)


def read_effect_owner(
    m: Mapping[str, object], path: str, issues: list[Diagnostic]
) -> EffectOwnerContract | None:
    p.reject_unknown_keys(m, frozenset({"owner_class", "effect_owner_kind"}), path, issues)
    oc = p.get_enum(m, "owner_class", EffectOwnerClass, path, issues)
    kind = p.get_str(m, "effect_owner_kind", path, issues, required=False)
    return None if oc is None else EffectOwnerContract(oc, kind)


def read_idempotency_policy(
    m: Mapping[str, object], path: str, issues: list[Diagnostic]
) -> IdempotencyPolicy | None:
    p.reject_unknown_keys(
        m, frozenset({"key_required", "key_shape", "uniqueness_scope"}), path, issues
    )
    required = p.get_bool(m, "key_required", path, issues)
    shape = p.get_str(m, "key_shape", path, issues, required=False)
    scope = p.get_enum(m, "uniqueness_scope", IdempotencyScope, path, issues, required=False)
    return IdempotencyPolicy(required, shape, scope or IdempotencyScope.UNSPECIFIED)


def read_security_policy(
    m: Mapping[str, object], path: str, issues: list[Diagnostic]
) -> SecurityPolicy | None:
    p.reject_unknown_keys(m, frozenset({"principal_mode", "reauthorization_policy"}), path, issues)
    pm = p.get_enum(m, "principal_mode", PrincipalMode, path, issues)
    rp = p.get_enum(m, "reauthorization_policy", ReauthorizationPolicy, path, issues)
    return None if pm is None or rp is None else SecurityPolicy(pm, rp)
