"""Capability-catalog input types: the §8.4 descriptor and one sealed generation's entries.

Re-exported by :mod:`.inputs`; split out only to keep modules small.
A capability value that the catalog did not declare is ``UNKNOWN`` (or
``None`` for free-form fields), so "missing" stays visible and fails closed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypeVar

from services.digest import versioned_digest

from ._fields import opt_int, opt_str, req_bool, req_str, str_tuple

__all__ = [
    "CapabilityDescriptor",
    "CapabilityEntryView",
    "CatalogGenerationRef",
    "EffectOwner",
    "EffectOwnerKind",
    "ExecutionClass",
    "FanoutBound",
    "FanoutKind",
    "IdempotencyPolicy",
    "LockPlan",
    "LockPlanKind",
    "OutputDurability",
    "ReadContract",
    "ReplayPolicy",
    "SecurityPolicy",
    "TransactionPolicy",
]


class ExecutionClass(StrEnum):
    """§8.4 ExecutionClass."""

    PURE_COMPUTE = "pure_compute"
    RECORD_READ = "record_read"
    RECORD_MUTATION = "record_mutation"
    WAIT = "wait"
    EXTERNAL_EFFECT = "external_effect"
    UNKNOWN = "unknown"


class TransactionPolicy(StrEnum):
    """§8.4 TransactionPolicy."""

    CALLER_TRANSACTION = "caller_transaction"
    OWNED_TRANSACTION = "owned_transaction"
    TRANSACTION_FORBIDDEN = "transaction_forbidden"
    PROFILE_DEPENDENT = "profile_dependent"
    UNKNOWN = "unknown"


class ReplayPolicy(StrEnum):
    """§8.4 ReplayPolicy."""

    DETERMINISTIC_REPLAY = "deterministic_replay"
    IDEMPOTENT_BY_KEY = "idempotent_by_key"
    AT_MOST_ONCE = "at_most_once"
    NOT_REPLAYABLE = "not_replayable"
    UNKNOWN = "unknown"


class FanoutKind(StrEnum):
    """§8.4 FanoutBound kinds."""

    STATIC = "static"
    METADATA_DERIVED = "metadata_derived"
    UNKNOWN = "unknown"


class ReadContract(StrEnum):
    """§8.4 ReadContract."""

    CHECKPOINT_ONLY = "checkpoint_only"
    CURRENT_TRANSACTIONAL = "current_transactional"
    VERIFIED_SNAPSHOT = "verified_snapshot"
    UNKNOWN = "unknown"


class LockPlanKind(StrEnum):
    """§8.4 LockPlanContract kinds."""

    STATIC_KEYS = "static_keys"
    METADATA_DERIVED = "metadata_derived"
    LATE_DISCOVERY_ALLOWED = "late_discovery_allowed"
    UNKNOWN = "unknown"


class EffectOwnerKind(StrEnum):
    """§8.4 EffectOwner kinds."""

    NONE = "none"
    INTEGRATION_WORK = "integration_work"
    RUNTIME_DELIVERY = "runtime_delivery"
    REGISTERED_OWNER = "registered_owner"
    UNKNOWN = "unknown"


class OutputDurability(StrEnum):
    """§8.4 OutputDurability."""

    EPHEMERAL = "ephemeral"
    CHECKPOINTED = "checkpointed"
    OWNER_RECEIPT = "owner_receipt"
    UNKNOWN = "unknown"


_E = TypeVar("_E", bound=StrEnum)


def _enum(cls: type[_E], d: Mapping[str, Any], key: str, where: str, unknown: _E) -> _E:
    raw = d.get(key)
    if raw is None:
        return unknown
    try:
        return cls(raw)
    except ValueError:
        return unknown  # an undeclared value is as good as missing: fail closed


# ---------------------------------------------------------------- catalog


@dataclass(frozen=True)
class CatalogGenerationRef:
    """Composite reference to one sealed capability-catalog generation (§7.4, §8.4)."""

    org_id: str
    app_installation_id: str
    runtime_capability_id: str
    binding_digest: str
    generation_id: str
    catalog_digest: str
    sealed: bool = True

    def to_dict(self) -> dict[str, Any]:
        """Canonical form (enters the plan and its digest)."""
        return {
            "org_id": self.org_id,
            "app_installation_id": self.app_installation_id,
            "runtime_capability_id": self.runtime_capability_id,
            "binding_digest": self.binding_digest,
            "generation_id": self.generation_id,
            "catalog_digest": self.catalog_digest,
            "sealed": self.sealed,
        }

    @classmethod
    def from_dict(
        cls, d: Mapping[str, Any], where: str = "catalog.generation"
    ) -> CatalogGenerationRef:
        """Decode from JSON."""
        return cls(
            org_id=req_str(d, "org_id", where),
            app_installation_id=req_str(d, "app_installation_id", where),
            runtime_capability_id=req_str(d, "runtime_capability_id", where),
            binding_digest=req_str(d, "binding_digest", where),
            generation_id=req_str(d, "generation_id", where),
            catalog_digest=req_str(d, "catalog_digest", where),
            sealed=req_bool(d, "sealed", where, default=True),
        )


@dataclass(frozen=True)
class FanoutBound:
    """Static maximum, metadata-derived maximum (through a relationship), or unknown."""

    kind: FanoutKind = FanoutKind.UNKNOWN
    max: int | None = None
    relationship: str | None = None


@dataclass(frozen=True)
class LockPlan:
    """Which resource classes an action locks and how its keys are known."""

    kind: LockPlanKind = LockPlanKind.UNKNOWN
    resource_classes: tuple[str, ...] = ()
    objects: tuple[str, ...] = ()


@dataclass(frozen=True)
class EffectOwner:
    """Who owns the remote outcome of an effect (``NONE`` for local actions)."""

    kind: EffectOwnerKind = EffectOwnerKind.UNKNOWN
    owner_id: str | None = None


@dataclass(frozen=True)
class IdempotencyPolicy:
    """Required idempotency key shape and uniqueness scope (``None`` = undeclared)."""

    key_shape: str | None = None
    scope: str | None = None


@dataclass(frozen=True)
class SecurityPolicy:
    """Required principal mode and reauthorization behaviour (``None`` = undeclared)."""

    principal_mode: str | None = None
    reauthorization: str | None = None


@dataclass(frozen=True)
class CapabilityDescriptor:
    """The eleven capability fields of §8.4, as plain typed values."""

    execution_class: ExecutionClass = ExecutionClass.UNKNOWN
    transaction_policy: TransactionPolicy = TransactionPolicy.UNKNOWN
    replay_policy: ReplayPolicy = ReplayPolicy.UNKNOWN
    fanout_bound: FanoutBound = field(default_factory=FanoutBound)
    read_contract: ReadContract = ReadContract.UNKNOWN
    lock_plan: LockPlan = field(default_factory=LockPlan)
    effect_owner: EffectOwner = field(default_factory=EffectOwner)
    idempotency: IdempotencyPolicy = field(default_factory=IdempotencyPolicy)
    output_durability: OutputDurability = OutputDurability.UNKNOWN
    security: SecurityPolicy = field(default_factory=SecurityPolicy)
    minimum_capability_version: int | None = None

    def unknown_fields(self) -> tuple[str, ...]:
        """Names of capability fields that are missing or unknown (sorted)."""
        out: list[str] = []
        if self.execution_class is ExecutionClass.UNKNOWN:
            out.append("execution_class")
        if self.transaction_policy is TransactionPolicy.UNKNOWN:
            out.append("transaction_policy")
        if self.replay_policy is ReplayPolicy.UNKNOWN:
            out.append("replay_policy")
        if self.fanout_bound.kind is FanoutKind.UNKNOWN:
            out.append("fanout_bound")
        if self.read_contract is ReadContract.UNKNOWN:
            out.append("read_contract")
        if self.lock_plan.kind is LockPlanKind.UNKNOWN:
            out.append("lock_plan")
        if self.effect_owner.kind is EffectOwnerKind.UNKNOWN:
            out.append("effect_owner")
        if self.idempotency.key_shape is None or self.idempotency.scope is None:
            out.append("idempotency")
        if self.output_durability is OutputDurability.UNKNOWN:
            out.append("output_durability")
        if self.security.principal_mode is None or self.security.reauthorization is None:
            out.append("security")
        if self.minimum_capability_version is None:
            out.append("minimum_capability_version")
        return tuple(sorted(out))

    def to_dict(self) -> dict[str, Any]:
        """Canonical form (digested into every plan that references it)."""
        return {
            "execution_class": self.execution_class.value,
            "transaction_policy": self.transaction_policy.value,
            "replay_policy": self.replay_policy.value,
            "fanout_bound": {
                "kind": self.fanout_bound.kind.value,
                "max": self.fanout_bound.max,
                "relationship": self.fanout_bound.relationship,
            },
            "read_contract": self.read_contract.value,
            "lock_plan": {
                "kind": self.lock_plan.kind.value,
                "resource_classes": sorted(self.lock_plan.resource_classes),
                "objects": sorted(self.lock_plan.objects),
            },
            "effect_owner": {
                "kind": self.effect_owner.kind.value,
                "owner_id": self.effect_owner.owner_id,
            },
            "idempotency": {
                "key_shape": self.idempotency.key_shape,
                "scope": self.idempotency.scope,
            },
            "output_durability": self.output_durability.value,
            "security": {
                "principal_mode": self.security.principal_mode,
                "reauthorization": self.security.reauthorization,
            },
            "minimum_capability_version": self.minimum_capability_version,
        }

    def digest(self) -> str:
        """Descriptor digest (§8.1 digest construction step 1)."""
        return versioned_digest("capability-descriptor", self.to_dict())

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str) -> CapabilityDescriptor:
        """Decode; absent or unrecognised values become ``UNKNOWN``."""
        fb = d.get("fanout_bound") or {}
        lp = d.get("lock_plan") or {}
        eo = d.get("effect_owner") or {}
        idem = d.get("idempotency") or {}
        sec = d.get("security") or {}
        return cls(
            execution_class=_enum(
                ExecutionClass, d, "execution_class", where, ExecutionClass.UNKNOWN
            ),
            transaction_policy=_enum(
                TransactionPolicy, d, "transaction_policy", where, TransactionPolicy.UNKNOWN
            ),
            replay_policy=_enum(ReplayPolicy, d, "replay_policy", where, ReplayPolicy.UNKNOWN),
            fanout_bound=FanoutBound(
                kind=_enum(FanoutKind, fb, "kind", where, FanoutKind.UNKNOWN),
                max=opt_int(fb, "max", f"{where}.fanout_bound"),
                relationship=opt_str(fb, "relationship", f"{where}.fanout_bound"),
            ),
            read_contract=_enum(ReadContract, d, "read_contract", where, ReadContract.UNKNOWN),
            lock_plan=LockPlan(
                kind=_enum(LockPlanKind, lp, "kind", where, LockPlanKind.UNKNOWN),
                resource_classes=str_tuple(lp, "resource_classes", f"{where}.lock_plan"),
                objects=str_tuple(lp, "objects", f"{where}.lock_plan"),
            ),
            effect_owner=EffectOwner(
                kind=_enum(EffectOwnerKind, eo, "kind", where, EffectOwnerKind.UNKNOWN),
                owner_id=opt_str(eo, "owner_id", f"{where}.effect_owner"),
            ),
            idempotency=IdempotencyPolicy(
                key_shape=opt_str(idem, "key_shape", f"{where}.idempotency"),
                scope=opt_str(idem, "scope", f"{where}.idempotency"),
            ),
            output_durability=_enum(
                OutputDurability, d, "output_durability", where, OutputDurability.UNKNOWN
            ),
            security=SecurityPolicy(
                principal_mode=opt_str(sec, "principal_mode", f"{where}.security"),
                reauthorization=opt_str(sec, "reauthorization", f"{where}.security"),
            ),
            minimum_capability_version=opt_int(d, "minimum_capability_version", where),
        )


@dataclass(frozen=True)
class CapabilityEntryView:
    """One effective entry of a sealed catalog generation (§8.1)."""

    action_type: str
    entry_digest: str
    binding_fingerprint: str
    capabilities: CapabilityDescriptor
    owner_id: str = ""
    handler_ref: str = ""
    handler_version: str = ""
    contract_only: bool = False

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str) -> CapabilityEntryView:
        """Decode from JSON."""
        return cls(
            action_type=req_str(d, "action_type", where),
            entry_digest=req_str(d, "entry_digest", where),
            binding_fingerprint=opt_str(d, "binding_fingerprint", where) or "",
            capabilities=CapabilityDescriptor.from_dict(
                d.get("capabilities") or {}, f"{where}.capabilities"
            ),
            owner_id=opt_str(d, "owner_id", where) or "",
            handler_ref=opt_str(d, "handler_ref", where) or "",
            handler_version=opt_str(d, "handler_version", where) or "",
            contract_only=req_bool(d, "contract_only", where, default=False),
        )
