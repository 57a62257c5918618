"""Proto <-> domain mapping of bindings, scopes, generations, entries, references and
runtime availability; plus request-digest and page-token encoding.

How a ``SubmitEntryRequest`` becomes a domain submission is described in
:mod:`catalog_svc.service` (:class:`~catalog_svc.service.EntryRequest`).
"""

from __future__ import annotations

import base64
import binascii
import json

from catalog_svc.domain import (
    BindingGap,
    CatalogEntry,
    RuntimeWorkBinding,
    RuntimeWorkBindingDigest,
    RuntimeWorkScope,
)
from catalog_svc.store import (
    BindingRecord,
    EntryRecord,
    GenerationRecord,
    HolderKind,
    ReferenceRecord,
    ReferentKind,
)
from services.errors import InvalidArgumentError
from services.proto import catalog_v1, common_v1

from .capability_mapping import descriptor_to_proto, handler_binding_to_proto
from .view_mapping import timestamp

__all__ = [
    "HOLDER_FROM_PROTO",
    "HOLDER_TO_PROTO",
    "binding_from_proto",
    "binding_to_proto",
    "decode_page_token",
    "encode_page_token",
    "entry_to_proto",
    "gap_to_proto",
    "generation_to_proto",
    "reference_to_proto",
    "registered_binding_to_proto",
    "scope_from_proto",
    "scope_to_proto",
]


_Holder = catalog_v1.ReferenceHolderKind
HOLDER_FROM_PROTO: dict[catalog_v1.ReferenceHolderKind.ValueType, HolderKind] = {
    _Holder.REFERENCE_HOLDER_KIND_ACTIVATED_PLAN: HolderKind.PLAN,
    _Holder.REFERENCE_HOLDER_KIND_NON_TERMINAL_RUN: HolderKind.FLOW_RUN,
    _Holder.REFERENCE_HOLDER_KIND_DIAGNOSTIC_RETENTION: HolderKind.DIAGNOSTIC,
}
HOLDER_TO_PROTO: dict[HolderKind, catalog_v1.ReferenceHolderKind.ValueType] = {
    v: k for k, v in HOLDER_FROM_PROTO.items()
}

_STATE_TO_PROTO = {
    "OPEN": catalog_v1.GenerationState.GENERATION_STATE_OPEN,
    "SEALED": catalog_v1.GenerationState.GENERATION_STATE_SEALED,
    "REJECTED": catalog_v1.GenerationState.GENERATION_STATE_REJECTED,
}


# -- scope and binding ------------------------------------------------------------------


def scope_from_proto(
    msg: common_v1.TrustedRuntimeWorkScope, prefix: str = "scope"
) -> RuntimeWorkScope:
    """The request's scope; every component is required (the interceptor already compared
    the non-empty ones with the credential).

    Raises:
        InvalidArgumentError: a component is empty.
    """
    for name in (
        "org_id",
        "app_installation_id",
        "runtime_capability_id",
        "runtime_work_binding_digest",
    ):
        if not getattr(msg, name):
            raise InvalidArgumentError(
                f"{prefix}.{name} is required",
                reason="missing_field",
                field_path=f"{prefix}.{name}",
            )
    return RuntimeWorkScope(
        msg.org_id,
        msg.app_installation_id,
        msg.runtime_capability_id,
        RuntimeWorkBindingDigest(msg.runtime_work_binding_digest),
    )


def scope_to_proto(scope: RuntimeWorkScope) -> common_v1.TrustedRuntimeWorkScope:
    return common_v1.TrustedRuntimeWorkScope(
        org_id=scope.org_id,
        app_installation_id=scope.app_installation_id,
        runtime_capability_id=scope.runtime_capability_id,
        runtime_work_binding_digest=scope.runtime_work_binding_digest,
    )


def binding_from_proto(msg: common_v1.RuntimeWorkBinding) -> RuntimeWorkBinding:
    """The domain binding (validated by the service)."""
    return RuntimeWorkBinding(
        org_id=msg.org_id,
        app_installation_id=msg.app_installation_id,
        runtime_capability_id=msg.runtime_capability_id,
        catalog_revision=msg.catalog_revision,
        schema_generation=msg.schema_generation,
        engine_generation=msg.engine_generation,
        catalog_snapshot_digest=msg.catalog_snapshot_digest,
        runtime_metadata_view_digest=msg.runtime_metadata_view_digest,
    )


def binding_to_proto(b: RuntimeWorkBinding) -> common_v1.RuntimeWorkBinding:
    return common_v1.RuntimeWorkBinding(
        org_id=b.org_id,
        app_installation_id=b.app_installation_id,
        runtime_capability_id=b.runtime_capability_id,
        catalog_revision=b.catalog_revision,
        schema_generation=b.schema_generation,
        engine_generation=b.engine_generation,
        catalog_snapshot_digest=b.catalog_snapshot_digest,
        runtime_metadata_view_digest=b.runtime_metadata_view_digest,
    )


def registered_binding_to_proto(record: BindingRecord) -> common_v1.RegisteredWorkBinding:
    return common_v1.RegisteredWorkBinding(
        binding=binding_to_proto(record.binding),
        runtime_work_binding_digest=record.digest,
        registered_at=timestamp(record.registered_at),
    )


# -- generations and entries ----------------------------------------------------------


def generation_to_proto(record: GenerationRecord) -> catalog_v1.CatalogGeneration:
    d = record.draft
    msg = catalog_v1.CatalogGeneration(
        scope=scope_to_proto(d.scope),
        runtime_work_binding=binding_to_proto(d.binding),
        catalog_generation_id=d.generation_id,
        catalog_digest=d.catalog_digest or "",
        contract_version=d.contract_version,
        state=_STATE_TO_PROTO[d.state.name],
        entry_count=len(d.entries),
        rejection_reasons=list(d.rejection_codes()),
        created_at=timestamp(record.created_at),
    )
    if record.sealed_at is not None:
        msg.sealed_at.CopyFrom(timestamp(record.sealed_at))
    return msg


def entry_to_proto(record: EntryRecord) -> catalog_v1.CatalogEntry:
    e: CatalogEntry = record.entry
    handler = (
        handler_binding_to_proto(e.handler_binding)
        if e.handler_binding is not None
        # A contract-only entry still names its designated owner.
        else common_v1.HandlerBinding(owner_registration_id=e.owner.registration_id)
    )
    return catalog_v1.CatalogEntry(
        catalog_generation_id=record.generation_id,
        action_type=e.action_type,
        source=catalog_v1.EntrySource.ValueType(e.owner.kind),
        handler_binding=handler,
        contract_only=e.handler_binding is None,
        descriptor=descriptor_to_proto(e.descriptor),
        descriptor_digest=e.descriptor_digest,
        binding_fingerprint=e.binding_fingerprint or "",
        entry_digest=e.entry_digest,
        created_at=timestamp(record.created_at),
    )


def reference_to_proto(record: ReferenceRecord) -> catalog_v1.ArtifactReference:
    ident = record.identity
    msg = catalog_v1.ArtifactReference(
        holder_kind=HOLDER_TO_PROTO[ident.holder_kind],
        holder_id=ident.holder_id,
        created_at=timestamp(record.created_at),
    )
    if ident.referent_kind is ReferentKind.CATALOG_GENERATION:
        msg.catalog_generation.CopyFrom(
            catalog_v1.GenerationTarget(
                catalog_generation_id=ident.referent_id, catalog_digest=record.catalog_digest or ""
            )
        )
    else:
        msg.metadata_view.CopyFrom(
            catalog_v1.MetadataViewTarget(runtime_metadata_view_digest=ident.referent_id)
        )
    if record.expires_at is not None:
        msg.retain_until.CopyFrom(timestamp(record.expires_at))
    return msg


def gap_to_proto(gap: BindingGap) -> catalog_v1.BindingGap:
    return catalog_v1.BindingGap(
        action_type=gap.action_type,
        entry_digest=gap.entry_digest,
        binding_fingerprint=gap.binding_fingerprint,
        reason=catalog_v1.BindingGapReason.ValueType(gap.reason),
    )


# -- page tokens ----------------------------------------------------------------------


def encode_page_token(generation_id: str, catalog_digest: str, after: str) -> str:
    """Opaque token resuming after action type ``after`` of one sealed generation."""
    raw = json.dumps({"g": generation_id, "d": catalog_digest, "a": after}, sort_keys=True)
    return base64.urlsafe_b64encode(raw.encode()).decode("ascii")


def decode_page_token(token: str, generation_id: str, catalog_digest: str) -> str | None:
    """The action type to resume after (``None`` for an empty token).

    Raises:
        InvalidArgumentError: malformed, or issued for another generation or digest.
    """
    if not token:
        return None
    try:
        raw = json.loads(base64.urlsafe_b64decode(token.encode("ascii")))
        if raw["g"] == generation_id and raw["d"] == catalog_digest and isinstance(raw["a"], str):
            return str(raw["a"])
    except (ValueError, KeyError, TypeError, binascii.Error, UnicodeEncodeError):
        pass
    raise InvalidArgumentError(
        "page_token is malformed or was issued for other filters",
        reason="invalid_page_token",
        field_path="page_token",
    )
