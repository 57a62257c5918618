"""Decoding of request fields the servicer needs beyond plain mapping: required ids,
request keys, entry submissions, references and handler tuples.

Length bounds are the storage column widths (``services.db``): a value that could never
be stored is refused here with ``INVALID_ARGUMENT`` naming the field.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime

from google.protobuf.message import Message

from catalog_svc.domain import (
    ActionType,
    BindingFingerprint,
    CatalogGenerationId,
    EntryDigest,
    HandlerRef,
    RuntimeHandlerTuple,
    RuntimeWorkBindingDigest,
    normalize_action_type,
    normalize_handler_ref,
)
from catalog_svc.service import EntryRequest, EntrySource
from catalog_svc.store import HolderKind, ReferenceIdentity, ReferentKind
from services.auth import TrustedIdentity
from services.db import DIGEST_LEN, ID_LEN, KEY_LEN, TOKEN_LEN
from services.digest import is_digest
from services.errors import InvalidArgumentError
from services.proto import catalog_v1
from services.request_dedupe import DedupeScope, RequestKey

from .capability_mapping import descriptor_from_proto, handler_binding_from_proto
from .issues import require_text
from .mapping import HOLDER_FROM_PROTO

__all__ = [
    "ReferenceRequest",
    "digest_field",
    "entry_request",
    "generation_id",
    "handler_tuples",
    "reference_request",
    "request_key",
]


def request_key(identity: TrustedIdentity, rpc: str, request: Message) -> RequestKey:
    """The deduplication key of a mutating request: the caller's complete trusted scope
    (every component its credential carries), the RPC and ``request_id`` (required)."""
    return RequestKey.of(DedupeScope.of_identity(identity), rpc, request)


def generation_id(value: str, path: str = "catalog_generation_id") -> str:
    """A required generation id."""
    return require_text(value, path, max_length=ID_LEN)


def digest_field(value: str, path: str, *, kind: str | None = None, required: bool = True) -> str:
    """A versioned digest string (``<kind>/v<n>:sha256:<hex>``)."""
    if not value and not required:
        return value
    require_text(value, path, max_length=DIGEST_LEN)
    if not is_digest(value, kind):
        raise InvalidArgumentError(
            f"{path} must be a versioned digest {kind or '<kind>'}/v<n>:sha256:<64 hex>",
            reason="invalid_format",
            field_path=path,
        )
    return value


def _invalid(path: str, message: str, reason: str = "inconsistent") -> InvalidArgumentError:
    return InvalidArgumentError(message, reason=reason, field_path=path)


def entry_request(req: catalog_v1.SubmitEntryRequest) -> EntryRequest:
    """Decode a ``SubmitEntryRequest`` (see :mod:`catalog_svc.service` for the meaning)."""
    require_text(req.action_type, "action_type", max_length=TOKEN_LEN)
    if len(normalize_action_type(req.action_type)) > TOKEN_LEN:
        raise _invalid("action_type", f"action_type is longer than {TOKEN_LEN}", "out_of_range")
    try:
        source = EntrySource(req.source)
    except ValueError:
        raise _invalid(
            "source", f"unknown EntrySource value {req.source}", "unknown_enum_value"
        ) from None
    if source is EntrySource.UNSPECIFIED:
        raise _invalid("source", "source is required", "missing_field")
    if not req.HasField("descriptor"):
        raise _invalid("descriptor", "descriptor is required", "missing_field")
    descriptor = descriptor_from_proto(req.descriptor, "descriptor")
    hb = req.handler_binding
    owner = require_text(
        hb.owner_registration_id,
        "handler_binding.owner_registration_id",
        max_length=TOKEN_LEN,
        what="handler_binding.owner_registration_id (the owner registration)",
    )
    if req.contract_only:
        if source is EntrySource.DISTRIBUTION:
            raise _invalid("contract_only", "a distribution submission binds a handler")
        for name in ("handler_ref", "handler_implementation_version", "service_release_digest"):
            if getattr(hb, name):
                raise _invalid(
                    f"handler_binding.{name}",
                    "a contract-only entry names its designated owner and no handler",
                )
        return EntryRequest(req.action_type, source, owner, descriptor, None)
    require_text(hb.handler_ref, "handler_binding.handler_ref", max_length=KEY_LEN)
    if len(hb.handler_implementation_version) > ID_LEN:
        raise _invalid(
            "handler_binding.handler_implementation_version",
            f"handler_implementation_version must be at most {ID_LEN} characters",
            "out_of_range",
        )
    return EntryRequest(req.action_type, source, owner, descriptor, handler_binding_from_proto(hb))


@dataclass(frozen=True, slots=True)
class ReferenceRequest:
    """A decoded ``ArtifactReference`` of a register or release request."""

    identity: ReferenceIdentity
    catalog_digest: str | None
    expires_at: datetime | None


def reference_request(msg: catalog_v1.ArtifactReference, *, register: bool) -> ReferenceRequest:
    """Decode a reference; a release needs only its identity (other fields are ignored)."""
    target = msg.WhichOneof("target")
    catalog_digest: str | None = None
    if target == "catalog_generation":
        referent = ReferentKind.CATALOG_GENERATION
        referent_id = generation_id(
            msg.catalog_generation.catalog_generation_id,
            "reference.catalog_generation.catalog_generation_id",
        )
        if register:
            catalog_digest = digest_field(
                msg.catalog_generation.catalog_digest,
                "reference.catalog_generation.catalog_digest",
                kind="catalog",
            )
    elif target == "metadata_view":
        referent = ReferentKind.METADATA_VIEW
        referent_id = digest_field(
            msg.metadata_view.runtime_metadata_view_digest,
            "reference.metadata_view.runtime_metadata_view_digest",
            kind="runtime_metadata_view",
        )
    else:
        raise _invalid(
            "reference.target",
            "a catalog_generation or metadata_view target is required",
            "missing_field",
        )
    if msg.holder_kind == 0:
        raise _invalid("reference.holder_kind", "holder_kind is required", "missing_field")
    holder: HolderKind | None = HOLDER_FROM_PROTO.get(msg.holder_kind)
    if holder is None:
        raise _invalid(
            "reference.holder_kind",
            f"unknown ReferenceHolderKind {msg.holder_kind}",
            "unknown_enum_value",
        )
    holder_id = require_text(msg.holder_id, "reference.holder_id", max_length=TOKEN_LEN)
    expires_at = msg.retain_until.ToDatetime(tzinfo=UTC) if msg.HasField("retain_until") else None
    if register and holder is HolderKind.DIAGNOSTIC and expires_at is None:
        raise _invalid(
            "reference.retain_until",
            "a diagnostic-retention reference needs retain_until",
            "missing_field",
        )
    return ReferenceRequest(
        ReferenceIdentity(referent, referent_id, holder, holder_id),
        catalog_digest,
        expires_at if register else None,
    )


def handler_tuples(
    tuples: Iterable[catalog_v1.HandlerAvailabilityTuple],
) -> list[RuntimeHandlerTuple]:
    """Decode and normalize published tuples; one per (generation, action type)."""
    out: list[RuntimeHandlerTuple] = []
    seen: set[tuple[str, str]] = set()
    for i, tp in enumerate(tuples):
        p = f"tuples[{i}]"
        digest_field(tp.runtime_work_binding_digest, f"{p}.runtime_work_binding_digest")
        gid = generation_id(tp.catalog_generation_id, f"{p}.catalog_generation_id")
        require_text(tp.action_type, f"{p}.action_type", max_length=TOKEN_LEN)
        action = normalize_action_type(tp.action_type)
        ref = normalize_handler_ref(
            require_text(tp.handler_ref, f"{p}.handler_ref", max_length=KEY_LEN)
        )
        entry = digest_field(tp.entry_digest, f"{p}.entry_digest", kind="catalog_entry")
        fp = digest_field(
            tp.binding_fingerprint, f"{p}.binding_fingerprint", kind="binding_fingerprint"
        )
        if (gid, action) in seen:
            raise _invalid(
                f"{p}.action_type", f"a second tuple for {action!r} in {gid!r}", "duplicate_name"
            )
        seen.add((gid, action))
        out.append(
            RuntimeHandlerTuple(
                RuntimeWorkBindingDigest(tp.runtime_work_binding_digest),
                CatalogGenerationId(gid),
                ActionType(action),
                HandlerRef(ref),
                EntryDigest(entry),
                BindingFingerprint(fp),
            )
        )
    return out
