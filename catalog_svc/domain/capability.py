"""The neutral L0 capability descriptor: the eleven fields of §8.4's table.

Every action and executable extension publishes one. Field names are the spec's names
in snake case; enumerated fields are closed ``IntEnum``s whose numbers mirror the proto
(``UNSPECIFIED = 0`` is "missing" and never valid, except for
``IdempotencyPolicy.uniqueness_scope`` where it means "no key"). The enums and value types
live in :mod:`.capability_types`; this module holds the descriptor, its validation, its
canonical JSON and its digest.

================================  ====================================================
Field (§8.4)                       Domain value
================================  ====================================================
ExecutionClass                     :class:`ExecutionClass`
TransactionPolicy                  :class:`TransactionPolicy`
ReplayPolicy                       :class:`ReplayPolicy`
FanoutBound                        :class:`FanoutBound` (kind + maximum or metadata path)
ReadContract                       :class:`ReadContract`
LockPlanContract                   :class:`LockPlanContract` (kind, static keys,
                                   resource classes, max keys — §13.2, §13.3)
EffectOwner                        :class:`EffectOwnerContract`
IdempotencyPolicy                  :class:`IdempotencyPolicy` (key shape grammar in
                                   :mod:`.idempotency_key`, uniqueness scope)
OutputDurability                   :class:`OutputDurability`
SecurityPolicy                     :class:`SecurityPolicy` (principal mode,
                                   reauthorization policy — §17)
MinimumCapabilityVersion           ``int`` >= 1
================================  ====================================================

Cross-field rules (the diagnostic's field in brackets):

X1. ``EXTERNAL_EFFECT`` if and only if ``effect_owner.owner_class`` is not ``NONE``
    [effect_owner.owner_class] (§15: an external effect has exactly one designated owner;
    nothing else hands off).
X2. ``WAIT`` and ``EXTERNAL_EFFECT`` need ``transaction_policy = TRANSACTION_FORBIDDEN``
    [transaction_policy] (§5.2.3 no transaction crosses a wait or network call; §8.4 rules).
X3. ``output_durability = OWNER_RECEIPT`` if and only if ``EXTERNAL_EFFECT``
    [output_durability] (§7.5: the completion step consumes the owner's receipt).
X4. ``PURE_COMPUTE`` needs ``read_contract = CHECKPOINT_ONLY`` [read_contract] (§7.5).
X5. ``replay_policy = IDEMPOTENT_BY_KEY`` needs a required key
    [idempotency_policy.key_required].
X6. ``security_policy.principal_mode = CALLER`` excludes ``WAIT`` and ``EXTERNAL_EFFECT``
    [security_policy.principal_mode]: the caller's authorization context exists only inside
    the caller's save (§9.1, §17.2).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from services.digest import versioned_digest

from . import _parse as p
from ._checks import check_enum, check_int, check_pattern, forbid
from .capability_types import (
    EffectOwnerClass,
    EffectOwnerContract,
    ExecutionClass,
    FanoutBound,
    FanoutBoundKind,
    IdempotencyPolicy,
    IdempotencyScope,
    LockPlanContract,
    LockPlanKind,
    OutputDurability,
    PrincipalMode,
    ReadContract,
    ReauthorizationPolicy,
    ReplayPolicy,
    SecurityPolicy,
    StaticResourceKey,
    TransactionPolicy,
    read_effect_owner,
    read_fanout_bound,
    read_idempotency_policy,
    read_lock_plan_contract,
    read_security_policy,
)
from .diagnostics import Diagnostic, DiagnosticCode, DomainValidationError
from .idempotency_key import KeyShapeError, parse_key_shape
from .ids import CONTRACT_VERSION, DESCRIPTOR_DIGEST_KIND, DescriptorDigest

__all__ = ["CapabilityDescriptor"]

_RESOURCE_CLASS_RE = re.compile(r"^[a-z][a-z0-9_]*$")
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:$-]*$")
_METADATA_PATH_RE = re.compile(r"^\$?[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*$")
_OWNER_KIND_RE = re.compile(r"^[a-z][a-z0-9_.-]*$")
_SHORT = 128
_PATHLEN = 256


@dataclass(frozen=True, slots=True)
class CapabilityDescriptor:
    """The complete §8.4 capability descriptor of one action (all eleven fields)."""

    execution_class: ExecutionClass
    transaction_policy: TransactionPolicy
    replay_policy: ReplayPolicy
    fanout_bound: FanoutBound
    read_contract: ReadContract
    lock_plan_contract: LockPlanContract
    effect_owner: EffectOwnerContract
    idempotency_policy: IdempotencyPolicy
    output_durability: OutputDurability
    security_policy: SecurityPolicy
    minimum_capability_version: int

    # -- validation ----------------------------------------------------------------------

    def validate(self) -> list[Diagnostic]:
        """Every issue; paths are field names relative to the descriptor."""
        out: list[Diagnostic] = []
        ok_exec = check_enum(self.execution_class, ExecutionClass, "execution_class", out)
        ok_txn = check_enum(self.transaction_policy, TransactionPolicy, "transaction_policy", out)
        ok_replay = check_enum(self.replay_policy, ReplayPolicy, "replay_policy", out)
        self._validate_fanout(out)
        ok_read = check_enum(self.read_contract, ReadContract, "read_contract", out)
        self._validate_lock_plan(out)
        ok_owner = self._validate_effect_owner(out)
        ok_idem = self._validate_idempotency(out)
        ok_out = check_enum(self.output_durability, OutputDurability, "output_durability", out)
        ok_principal = self._validate_security(out)
        check_int(self.minimum_capability_version, 1, "minimum_capability_version", out)
        if not ok_exec:
            return out
        ec = self.execution_class
        effectful = ec in (ExecutionClass.WAIT, ExecutionClass.EXTERNAL_EFFECT)
        is_effect = ec is ExecutionClass.EXTERNAL_EFFECT
        if ok_owner and is_effect != (self.effect_owner.owner_class is not EffectOwnerClass.NONE):
            out.append(
                Diagnostic(
                    "effect_owner.owner_class",
                    DiagnosticCode.INCONSISTENT,
                    "an external_effect action needs an effect owner, and only an external_effect "
                    "action may declare one (X1)",
                )
            )
        if (
            ok_txn
            and effectful
            and self.transaction_policy is not TransactionPolicy.TRANSACTION_FORBIDDEN
        ):
            out.append(
                Diagnostic(
                    "transaction_policy",
                    DiagnosticCode.INCONSISTENT,
                    f"{ec.name.lower()} actions must declare transaction_forbidden (X2)",
                )
            )
        if ok_out and is_effect != (self.output_durability is OutputDurability.OWNER_RECEIPT):
            out.append(
                Diagnostic(
                    "output_durability",
                    DiagnosticCode.INCONSISTENT,
                    "owner_receipt durability if and only if external_effect (X3)",
                )
            )
        if (
            ok_read
            and ec is ExecutionClass.PURE_COMPUTE
            and self.read_contract is not ReadContract.CHECKPOINT_ONLY
        ):
            out.append(
                Diagnostic(
                    "read_contract",
                    DiagnosticCode.INCONSISTENT,
                    "pure_compute reads checkpoints only (X4)",
                )
            )
        if (
            ok_replay
            and ok_idem
            and self.replay_policy is ReplayPolicy.IDEMPOTENT_BY_KEY
            and not self.idempotency_policy.key_required
        ):
            out.append(
                Diagnostic(
                    "idempotency_policy.key_required",
                    DiagnosticCode.INCONSISTENT,
                    "replay_policy idempotent_by_key needs a required key (X5)",
                )
            )
        if (
            ok_principal
            and effectful
            and self.security_policy.principal_mode is PrincipalMode.CALLER
        ):
            out.append(
                Diagnostic(
                    "security_policy.principal_mode",
                    DiagnosticCode.INCONSISTENT,
                    f"principal mode caller cannot outlive the caller's save; {ec.name.lower()} "
                    "actions need initiating_principal or system (X6)",
                )
            )
        return out

    def _validate_fanout(self, out: list[Diagnostic]) -> None:
        fb = self.fanout_bound
        if not isinstance(fb, FanoutBound):
            out.append(
                Diagnostic("fanout_bound", DiagnosticCode.MISSING_FIELD, "fanout_bound is required")
            )
            return
        if not check_enum(fb.kind, FanoutBoundKind, "fanout_bound.kind", out):
            return
        if fb.kind is FanoutBoundKind.STATIC_MAXIMUM:
            if fb.static_maximum is None:
                out.append(
                    Diagnostic(
                        "fanout_bound.static_maximum",
                        DiagnosticCode.MISSING_FIELD,
                        "static maximum required",
                    )
                )
            else:
                check_int(fb.static_maximum, 1, "fanout_bound.static_maximum", out)
        else:
            forbid(
                fb.static_maximum is not None,
                "fanout_bound.static_maximum",
                "only for static_maximum",
                out,
            )
        if fb.kind is FanoutBoundKind.METADATA_DERIVED_MAXIMUM:
            check_pattern(
                fb.metadata_path,
                _METADATA_PATH_RE,
                _PATHLEN,
                "fanout_bound.metadata_path",
                "metadata path",
                out,
            )
        else:
            forbid(
                fb.metadata_path is not None,
                "fanout_bound.metadata_path",
                "only for metadata_derived_maximum",
                out,
            )

    def _validate_lock_plan(self, out: list[Diagnostic]) -> None:
        lp = self.lock_plan_contract
        base = "lock_plan_contract"
        if not isinstance(lp, LockPlanContract):
            out.append(
                Diagnostic(base, DiagnosticCode.MISSING_FIELD, "lock_plan_contract is required")
            )
            return
        if not check_enum(lp.kind, LockPlanKind, f"{base}.kind", out):
            return
        classes: set[str] = set()
        for i, rc in enumerate(lp.resource_classes):
            path = f"{base}.resource_classes[{i}]"
            if check_pattern(rc, _RESOURCE_CLASS_RE, _SHORT, path, "resource class", out):
                if rc in classes:
                    out.append(
                        Diagnostic(
                            path, DiagnosticCode.DUPLICATE_NAME, f"duplicate resource class {rc!r}"
                        )
                    )
                classes.add(rc)
        if lp.kind is LockPlanKind.UNKNOWN:
            forbid(
                bool(lp.resource_classes),
                f"{base}.resource_classes",
                "unknown lock plans declare nothing",
                out,
            )
            forbid(
                lp.max_keys is not None,
                f"{base}.max_keys",
                "unknown lock plans declare nothing",
                out,
            )
        elif lp.kind is not LockPlanKind.STATIC_KEYS and not lp.resource_classes:
            out.append(
                Diagnostic(
                    f"{base}.resource_classes",
                    DiagnosticCode.MISSING_FIELD,
                    "declare the lockable classes",
                )
            )
        if lp.max_keys is not None:
            check_int(lp.max_keys, 1, f"{base}.max_keys", out)
        elif lp.kind is LockPlanKind.LATE_DISCOVERY_ALLOWED:
            out.append(
                Diagnostic(
                    f"{base}.max_keys",
                    DiagnosticCode.MISSING_FIELD,
                    "late discovery needs a key bound (§13.3)",
                )
            )
        if lp.kind is not LockPlanKind.STATIC_KEYS:
            forbid(bool(lp.static_keys), f"{base}.static_keys", "only for static_keys", out)
            return
        seen: set[StaticResourceKey] = set()
        for i, key in enumerate(lp.static_keys):
            path = f"{base}.static_keys[{i}]"
            class_path = f"{path}.resource_class"
            rc_ok = check_pattern(
                key.resource_class, _RESOURCE_CLASS_RE, _SHORT, class_path, "class", out
            )
            if rc_ok and key.resource_class not in classes:
                out.append(
                    Diagnostic(
                        f"{path}.resource_class",
                        DiagnosticCode.INCONSISTENT,
                        f"class {key.resource_class!r} is not in resource_classes",
                    )
                )
            check_pattern(
                key.namespace, _NAMESPACE_RE, _SHORT, f"{path}.namespace", "namespace", out
            )
            for attr in ("record_identity", "partition"):
                v = getattr(key, attr)
                if v is not None and (not isinstance(v, str) or not v.strip() or len(v) > _PATHLEN):
                    out.append(
                        Diagnostic(
                            f"{path}.{attr}",
                            DiagnosticCode.INVALID_FORMAT,
                            "non-blank, <= 256 chars",
                        )
                    )
            check_int(key.ordering_version, 1, f"{path}.ordering_version", out)
            if key in seen:
                out.append(Diagnostic(path, DiagnosticCode.DUPLICATE_NAME, "duplicate static key"))
            seen.add(key)
        if isinstance(lp.max_keys, int) and lp.max_keys < len(lp.static_keys):
            out.append(
                Diagnostic(
                    f"{base}.max_keys",
                    DiagnosticCode.OUT_OF_RANGE,
                    "smaller than the static key count",
                )
            )

    def _validate_effect_owner(self, out: list[Diagnostic]) -> bool:
        eo = self.effect_owner
        if not isinstance(eo, EffectOwnerContract):
            out.append(
                Diagnostic("effect_owner", DiagnosticCode.MISSING_FIELD, "effect_owner is required")
            )
            return False
        if not check_enum(eo.owner_class, EffectOwnerClass, "effect_owner.owner_class", out):
            return False
        if eo.owner_class is EffectOwnerClass.NONE:
            forbid(
                eo.effect_owner_kind is not None,
                "effect_owner.effect_owner_kind",
                "no owner, no kind",
                out,
            )
            return True
        return check_pattern(
            eo.effect_owner_kind,
            _OWNER_KIND_RE,
            _SHORT,
            "effect_owner.effect_owner_kind",
            "effect owner kind",
            out,
        )

    def _validate_idempotency(self, out: list[Diagnostic]) -> bool:
        ip = self.idempotency_policy
        base = "idempotency_policy"
        if not isinstance(ip, IdempotencyPolicy):
            out.append(
                Diagnostic(base, DiagnosticCode.MISSING_FIELD, "idempotency_policy is required")
            )
            return False
        if not isinstance(ip.key_required, bool):
            out.append(
                Diagnostic(f"{base}.key_required", DiagnosticCode.INVALID_TYPE, "must be a boolean")
            )
            return False
        if not isinstance(ip.uniqueness_scope, IdempotencyScope):
            out.append(
                Diagnostic(
                    f"{base}.uniqueness_scope",
                    DiagnosticCode.UNKNOWN_ENUM_VALUE,
                    "unknown IdempotencyScope",
                )
            )
            return False
        before = len(out)
        if not ip.key_required:
            forbid(
                ip.key_shape is not None, f"{base}.key_shape", "a key shape needs key_required", out
            )
            forbid(
                ip.uniqueness_scope is not IdempotencyScope.UNSPECIFIED,
                f"{base}.uniqueness_scope",
                "a uniqueness scope needs key_required",
                out,
            )
            return len(out) == before
        if ip.uniqueness_scope is IdempotencyScope.UNSPECIFIED:
            out.append(
                Diagnostic(
                    f"{base}.uniqueness_scope", DiagnosticCode.MISSING_FIELD, "required with a key"
                )
            )
        shape_path = f"{base}.key_shape"
        if ip.key_shape is None:
            out.append(Diagnostic(shape_path, DiagnosticCode.MISSING_FIELD, "required with a key"))
            return False
        if not isinstance(ip.key_shape, str):
            out.append(
                Diagnostic(shape_path, DiagnosticCode.INVALID_TYPE, "key shape must be a string")
            )
            return False
        try:
            refs = [s.ref for s in parse_key_shape(ip.key_shape) if s.ref is not None]
        except KeyShapeError as exc:
            out.append(Diagnostic(shape_path, DiagnosticCode.INVALID_FORMAT, str(exc)))
            return False
        if not refs:
            out.append(
                Diagnostic(
                    shape_path,
                    DiagnosticCode.INVALID_FORMAT,
                    "a constant key collapses every invocation",
                )
            )
        wide = ip.uniqueness_scope in (IdempotencyScope.RUNTIME_WORK_SCOPE, IdempotencyScope.ORG)
        if wide and refs and not any(r == "run.id" or r.startswith("input.") for r in refs):
            out.append(
                Diagnostic(
                    shape_path,
                    DiagnosticCode.INVALID_FORMAT,
                    "a key unique beyond one run must reference ${run.id} or an ${input.*}",
                )
            )
        return len(out) == before

    def _validate_security(self, out: list[Diagnostic]) -> bool:
        sp = self.security_policy
        if not isinstance(sp, SecurityPolicy):
            out.append(
                Diagnostic(
                    "security_policy", DiagnosticCode.MISSING_FIELD, "security_policy is required"
                )
            )
            return False
        ok = check_enum(sp.principal_mode, PrincipalMode, "security_policy.principal_mode", out)
        check_enum(
            sp.reauthorization_policy,
            ReauthorizationPolicy,
            "security_policy.reauthorization_policy",
            out,
        )
        return ok

    # -- normalization, JSON, digest -----------------------------------------------------

    def normalized(self) -> CapabilityDescriptor:
        """The same descriptor with its set-valued fields sorted."""
        lp = self.lock_plan_contract
        return replace(
            self,
            lock_plan_contract=replace(
                lp,
                static_keys=tuple(sorted(lp.static_keys)),
                resource_classes=tuple(sorted(lp.resource_classes)),
            ),
        )

    def to_dict(self) -> dict[str, object]:
        """Normalized JSON shape; also the canonical form that is digested."""
        d = self.normalized()
        fb, lp, eo, ip, sp = (
            d.fanout_bound,
            d.lock_plan_contract,
            d.effect_owner,
            d.idempotency_policy,
            d.security_policy,
        )
        return {
            "execution_class": p.enum_to_json(d.execution_class),
            "transaction_policy": p.enum_to_json(d.transaction_policy),
            "replay_policy": p.enum_to_json(d.replay_policy),
            "fanout_bound": {
                "kind": p.enum_to_json(fb.kind),
                "static_maximum": fb.static_maximum,
                "metadata_path": fb.metadata_path,
            },
            "read_contract": p.enum_to_json(d.read_contract),
            "lock_plan_contract": {
                "kind": p.enum_to_json(lp.kind),
                "static_keys": [
                    {
                        "resource_class": k.resource_class,
                        "namespace": k.namespace,
                        "record_identity": k.record_identity,
                        "partition": k.partition,
                        "ordering_version": k.ordering_version,
                    }
                    for k in lp.static_keys
                ],
                "resource_classes": list(lp.resource_classes),
                "max_keys": lp.max_keys,
            },
            "effect_owner": {
                "owner_class": p.enum_to_json(eo.owner_class),
                "effect_owner_kind": eo.effect_owner_kind,
            },
            "idempotency_policy": {
                "key_required": ip.key_required,
                "key_shape": ip.key_shape,
                "uniqueness_scope": (
                    None
                    if ip.uniqueness_scope is IdempotencyScope.UNSPECIFIED
                    else p.enum_to_json(ip.uniqueness_scope)
                ),
            },
            "output_durability": p.enum_to_json(d.output_durability),
            "security_policy": {
                "principal_mode": p.enum_to_json(sp.principal_mode),
                "reauthorization_policy": p.enum_to_json(sp.reauthorization_policy),
            },
            "minimum_capability_version": d.minimum_capability_version,
        }

    def digest(self) -> DescriptorDigest:
        """Descriptor digest (kind ``capability_descriptor``, version = ``CONTRACT_VERSION``)."""
        return DescriptorDigest(
            versioned_digest(DESCRIPTOR_DIGEST_KIND, self.to_dict(), version=CONTRACT_VERSION)
        )

    @classmethod
    def parse(cls, raw: object, path: str, issues: list[Diagnostic]) -> CapabilityDescriptor | None:
        """Read the JSON shape at ``path``, appending shape issues; ``None`` when unusable."""
        m = p.expect_mapping(raw, path, issues)
        if m is None:
            return None
        before = len(issues)
        p.reject_unknown_keys(m, _DESCRIPTOR_KEYS, path, issues)
        ec = p.get_enum(m, "execution_class", ExecutionClass, path, issues)
        tp = p.get_enum(m, "transaction_policy", TransactionPolicy, path, issues)
        rp = p.get_enum(m, "replay_policy", ReplayPolicy, path, issues)
        fb = p.read_object(m, "fanout_bound", path, issues, read_fanout_bound)
        rc = p.get_enum(m, "read_contract", ReadContract, path, issues)
        lp = p.read_object(m, "lock_plan_contract", path, issues, read_lock_plan_contract)
        eo = p.read_object(m, "effect_owner", path, issues, read_effect_owner)
        ip = p.read_object(m, "idempotency_policy", path, issues, read_idempotency_policy)
        od = p.get_enum(m, "output_durability", OutputDurability, path, issues)
        sp = p.read_object(m, "security_policy", path, issues, read_security_policy)
        mcv = p.get_int(m, "minimum_capability_version", path, issues, required=True)
        if (
            len(issues) > before
            or ec is None
            or tp is None
            or rp is None
            or fb is None
            or rc is None
            or lp is None
            or eo is None
            or ip is None
            or od is None
            or sp is None
            or mcv is None
        ):
            return None
        return cls(ec, tp, rp, fb, rc, lp, eo, ip, od, sp, mcv)

    @classmethod
    def from_dict(cls, raw: object) -> CapabilityDescriptor:
        """Parse and validate the JSON shape.

        Raises:
            DomainValidationError: every shape and field issue found.
        """
        issues: list[Diagnostic] = []
        desc = cls.parse(raw, "", issues)
        if desc is not None:
            issues = desc.validate()
        if issues or desc is None:
            raise DomainValidationError("capability descriptor", tuple(issues))
        return desc.normalized()


_DESCRIPTOR_KEYS = frozenset(
    {
        "execution_class",
        "transaction_policy",
        "replay_policy",
        "fanout_bound",
        "read_contract",
        "lock_plan_contract",
        "effect_owner",
        "idempotency_policy",
        "output_durability",
        "security_policy",
        "minimum_capability_version",
    }
)
