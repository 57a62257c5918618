"""Proto <-> domain mapping of the §8.4 capability descriptor and the handler binding.

proto3 has no presence for scalars, so "unset" and the zero value coincide; the mapping
reads them as the domain's "absent": ``0``/``""`` optional scalars become ``None``
(``static_maximum``, ``metadata_path``, ``max_keys``, ``effect_owner_kind``, ``key_shape``,
``record_identity``, ``partition``, an empty handler version or release digest), and an
unset message becomes a value whose kind is ``UNSPECIFIED`` — which the domain reports as
the missing field. Enum numbers outside the domain's closed sets are reported as
``unknown_enum_value`` at their request path.
"""

from __future__ import annotations

from catalog_svc.domain import (
    CapabilityDescriptor,
    Diagnostic,
    EffectOwnerClass,
    EffectOwnerContract,
    ExecutionClass,
    FanoutBound,
    FanoutBoundKind,
    HandlerBinding,
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
)
from services.proto import common_v1

from .issues import enum_value, invalid

__all__ = [
    "descriptor_from_proto",
    "descriptor_to_proto",
    "handler_binding_from_proto",
    "handler_binding_to_proto",
]


def _opt_int(value: int) -> int | None:
    return value if value else None


def _opt_str(value: str) -> str | None:
    return value if value else None


def descriptor_from_proto(msg: common_v1.CapabilityDescriptor, prefix: str) -> CapabilityDescriptor:
    """The domain descriptor of ``msg`` (not yet validated against the §8.4 rules).

    Raises:
        InvalidArgumentError: an enum number is unknown (the first such field is named;
            the descriptor's other issues are listed too).
    """
    issues: list[Diagnostic] = []

    fb, lp, eo = msg.fanout_bound, msg.lock_plan_contract, msg.effect_owner
    ip, sp = msg.idempotency_policy, msg.security_policy
    descriptor = CapabilityDescriptor(
        execution_class=enum_value(ExecutionClass, msg.execution_class, "execution_class", issues),
        transaction_policy=enum_value(
            TransactionPolicy, msg.transaction_policy, "transaction_policy", issues
        ),
        replay_policy=enum_value(ReplayPolicy, msg.replay_policy, "replay_policy", issues),
        fanout_bound=FanoutBound(
            kind=enum_value(FanoutBoundKind, fb.kind, "fanout_bound.kind", issues),
            static_maximum=_opt_int(fb.static_maximum),
            metadata_path=_opt_str(fb.metadata_path),
        ),
        read_contract=enum_value(ReadContract, msg.read_contract, "read_contract", issues),
        lock_plan_contract=LockPlanContract(
            kind=enum_value(LockPlanKind, lp.kind, "lock_plan_contract.kind", issues),
            static_keys=tuple(
                StaticResourceKey(
                    resource_class=k.resource_class,
                    namespace=k.namespace,
                    record_identity=_opt_str(k.record_identity),
                    partition=_opt_str(k.partition),
                    ordering_version=k.ordering_version,
                )
                for k in lp.static_keys
            ),
            resource_classes=tuple(lp.resource_classes),
            max_keys=_opt_int(lp.max_keys),
        ),
        effect_owner=EffectOwnerContract(
            owner_class=enum_value(
                EffectOwnerClass, eo.owner_class, "effect_owner.owner_class", issues
            ),
            effect_owner_kind=_opt_str(eo.effect_owner_kind),
        ),
        idempotency_policy=IdempotencyPolicy(
            key_required=ip.key_required,
            key_shape=_opt_str(ip.key_shape),
            uniqueness_scope=enum_value(
                IdempotencyScope, ip.uniqueness_scope, "idempotency_policy.uniqueness_scope", issues
            ),
        ),
        output_durability=enum_value(
            OutputDurability, msg.output_durability, "output_durability", issues
        ),
        security_policy=SecurityPolicy(
            principal_mode=enum_value(
                PrincipalMode, sp.principal_mode, "security_policy.principal_mode", issues
            ),
            reauthorization_policy=enum_value(
                ReauthorizationPolicy,
                sp.reauthorization_policy,
                "security_policy.reauthorization_policy",
                issues,
            ),
        ),
        minimum_capability_version=msg.minimum_capability_version,
    )
    if issues:
        # An unknown enum number reads as UNSPECIFIED, which validate() would call missing.
        reported = {d.path for d in issues}
        issues += [d for d in descriptor.validate() if d.path not in reported]
        raise invalid(issues, prefix)
    return descriptor


def descriptor_to_proto(d: CapabilityDescriptor) -> common_v1.CapabilityDescriptor:
    """The proto of a (normalized) domain descriptor."""
    fb, lp, eo, ip, sp = (
        d.fanout_bound,
        d.lock_plan_contract,
        d.effect_owner,
        d.idempotency_policy,
        d.security_policy,
    )
    return common_v1.CapabilityDescriptor(
        execution_class=common_v1.ExecutionClass.ValueType(d.execution_class),
        transaction_policy=common_v1.TransactionPolicy.ValueType(d.transaction_policy),
        replay_policy=common_v1.ReplayPolicy.ValueType(d.replay_policy),
        fanout_bound=common_v1.FanoutBound(
            kind=common_v1.FanoutBoundKind.ValueType(fb.kind),
            static_maximum=fb.static_maximum or 0,
            metadata_path=fb.metadata_path or "",
        ),
        read_contract=common_v1.ReadContract.ValueType(d.read_contract),
        lock_plan_contract=common_v1.LockPlanContract(
            kind=common_v1.LockPlanKind.ValueType(lp.kind),
            static_keys=[
                common_v1.ResourceKey(
                    resource_class=k.resource_class,
                    namespace=k.namespace,
                    record_identity=k.record_identity or "",
                    partition=k.partition or "",
                    ordering_version=k.ordering_version,
                )
                for k in lp.static_keys
            ],
            resource_classes=list(lp.resource_classes),
            max_keys=lp.max_keys or 0,
        ),
        effect_owner=common_v1.EffectOwnerContract(
            owner_class=common_v1.EffectOwnerClass.ValueType(eo.owner_class),
            effect_owner_kind=eo.effect_owner_kind or "",
        ),
        idempotency_policy=common_v1.IdempotencyPolicy(
            key_required=ip.key_required,
            key_shape=ip.key_shape or "",
            uniqueness_scope=common_v1.IdempotencyScope.ValueType(ip.uniqueness_scope),
        ),
        output_durability=common_v1.OutputDurability.ValueType(d.output_durability),
        security_policy=common_v1.SecurityPolicy(
            principal_mode=common_v1.PrincipalMode.ValueType(sp.principal_mode),
            reauthorization_policy=common_v1.ReauthorizationPolicy.ValueType(
                sp.reauthorization_policy
            ),
        ),
        minimum_capability_version=d.minimum_capability_version,
    )


def handler_binding_from_proto(msg: common_v1.HandlerBinding) -> HandlerBinding:
    """The domain handler binding (validated later by the domain builder)."""
    return HandlerBinding(
        owner_registration_id=msg.owner_registration_id,
        handler_ref=msg.handler_ref,
        handler_implementation_version=_opt_str(msg.handler_implementation_version),
        service_release_digest=_opt_str(msg.service_release_digest),
    )


def handler_binding_to_proto(hb: HandlerBinding) -> common_v1.HandlerBinding:
    """The proto of a domain handler binding (the asserted capability has no proto field)."""
    return common_v1.HandlerBinding(
        owner_registration_id=hb.owner_registration_id,
        handler_ref=hb.handler_ref,
        handler_implementation_version=hb.handler_implementation_version or "",
        service_release_digest=hb.service_release_digest or "",
    )
