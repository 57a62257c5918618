"""Catalog entry submissions, admitted entries and the non-circular digest chain (§8.1).

Digest chain, each step over the canonical JSON of the previous step's outputs:

1. ``descriptor_digest = versioned_digest("capability_descriptor", descriptor,
   version=CONTRACT_VERSION)``;
2. ``BindingFingerprint = versioned_digest("binding_fingerprint", {owner_registration_id,
   handler_ref (normalized), handler_implementation_version | service_release_digest,
   descriptor_digest})`` — the digest-algorithm version is the ``/v1`` of the kind,
   which ``versioned_digest`` also mixes into the hashed bytes;
3. ``EntryDigest = versioned_digest("catalog_entry", {action_type, owner{kind,
   registration_id}, descriptor_digest, contract_only, handler_binding{…,
   asserted_capability_digest} | null, binding_fingerprint | null})``;
4. ``CatalogDigest`` (in :mod:`.generation`) over the ``RuntimeWorkBindingDigest`` and
   the sorted entry digests.

No step reads its own output, so the chain is non-circular. A contract-only entry
(no handler binding) has no fingerprint and is never executable.

Submission JSON shape (``flowctl catalog`` files use it too)::

    {"action_type": "acme.send_invoice",
     "owner": {"kind": "pack", "registration_id": "pack:acme.billing"},
     "descriptor": {...CapabilityDescriptor.to_dict() shape...},
     "handler_binding": {"owner_registration_id": "pack:acme.billing",
                         "handler_ref": "python:acme.billing.handlers:send_invoice",
                         "handler_implementation_version": "1.4.0",
                         "service_release_digest": null,
                         "asserted_capability": null}}
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import IntEnum

from services.digest import is_digest, versioned_digest

from . import _parse as p
from .capability import CapabilityDescriptor
from .diagnostics import CatalogDiagnostic, Diagnostic, DiagnosticCode, DomainValidationError
from .ids import (
    BINDING_FINGERPRINT_KIND,
    ENTRY_DIGEST_KIND,
    ActionType,
    BindingFingerprint,
    DescriptorDigest,
    EntryDigest,
    HandlerRef,
    check_action_type,
    check_handler_ref,
    check_identifier,
    normalize_action_type,
    normalize_handler_ref,
)

__all__ = [
    "ActionOwner",
    "CatalogEntry",
    "CatalogEntrySubmission",
    "HandlerBinding",
    "OwnerKind",
    "compute_binding_fingerprint",
    "compute_entry_digest",
]

_VERSION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+:-]*$")
_VERSION_MAX = 128


class OwnerKind(IntEnum):
    """Who owns an action type (§8.1 sources that declare actions)."""

    UNSPECIFIED = 0
    PLATFORM = 1  # generic and platform-owned runtime registrations
    PACK = 2  # active pack action descriptors read through the Catalog authority
    EXTENSION = 3  # separately released neutral extension registrations


@dataclass(frozen=True, slots=True)
class ActionOwner:
    """Stable owner/registration identity of an action type."""

    kind: OwnerKind
    registration_id: str

    def validate(self) -> list[Diagnostic]:
        """Issues; paths relative to the owner."""
        out: list[Diagnostic] = []
        if not isinstance(self.kind, OwnerKind):
            out.append(
                Diagnostic(
                    "kind", DiagnosticCode.UNKNOWN_ENUM_VALUE, f"unknown OwnerKind {self.kind!r}"
                )
            )
        elif self.kind is OwnerKind.UNSPECIFIED:
            out.append(Diagnostic("kind", DiagnosticCode.MISSING_FIELD, "owner kind is required"))
        out += check_identifier(self.registration_id, "registration_id", "registration id")
        return out

    def to_dict(self) -> dict[str, object]:
        """JSON/canonical shape."""
        return {"kind": p.enum_to_json(self.kind), "registration_id": self.registration_id}

    def __str__(self) -> str:
        return f"{self.kind.name.lower()}:{self.registration_id}"


@dataclass(frozen=True, slots=True)
class HandlerBinding:
    """Release-owned binding of an action to its runtime handler (§8.1).

    Exactly one of ``handler_implementation_version`` and ``service_release_digest`` is
    set; any handler change must change it. ``asserted_capability`` is the descriptor the
    handler implementation asserts; when set it must not broaden the entry's descriptor
    (see :mod:`.broadening`); ``None`` asserts exactly the declared descriptor.
    """

    owner_registration_id: str
    handler_ref: str
    handler_implementation_version: str | None = None
    service_release_digest: str | None = None
    asserted_capability: CapabilityDescriptor | None = None

    def normalized(self) -> HandlerBinding:
        """Normalized handler reference and asserted capability."""
        cap = self.asserted_capability
        return replace(
            self,
            handler_ref=normalize_handler_ref(self.handler_ref),
            asserted_capability=None if cap is None else cap.normalized(),
        )

    def validate(self) -> list[Diagnostic]:
        """Issues; paths relative to the handler binding."""
        out = check_identifier(
            self.owner_registration_id, "owner_registration_id", "owner registration id"
        )
        ref = self.handler_ref
        out += check_handler_ref(
            normalize_handler_ref(ref) if isinstance(ref, str) else ref, "handler_ref"
        )
        version, release = self.handler_implementation_version, self.service_release_digest
        if version is None and release is None:
            out.append(
                Diagnostic(
                    "handler_implementation_version",
                    DiagnosticCode.MISSING_FIELD,
                    "an implementation version or a service-release digest is required",
                )
            )
        elif version is not None and release is not None:
            out.append(
                Diagnostic(
                    "service_release_digest",
                    DiagnosticCode.INCONSISTENT,
                    "give an implementation version or a service-release digest, not both",
                )
            )
        if version is not None and (
            not isinstance(version, str)
            or len(version) > _VERSION_MAX
            or not _VERSION_RE.match(version)
        ):
            out.append(
                Diagnostic(
                    "handler_implementation_version",
                    DiagnosticCode.INVALID_FORMAT,
                    f"version must match {_VERSION_RE.pattern} (<= {_VERSION_MAX} characters)",
                )
            )
        if release is not None and (not isinstance(release, str) or not is_digest(release)):
            out.append(
                Diagnostic(
                    "service_release_digest",
                    DiagnosticCode.INVALID_FORMAT,
                    "must be a versioned digest <kind>/v<n>:sha256:<64 hex>",
                )
            )
        if self.asserted_capability is not None:
            out += [
                Diagnostic(f"asserted_capability.{d.path}", d.code, d.message)
                for d in self.asserted_capability.validate()
            ]
        return out

    def to_dict(self) -> dict[str, object]:
        """JSON shape (normalized)."""
        n = self.normalized()
        return {
            "owner_registration_id": n.owner_registration_id,
            "handler_ref": n.handler_ref,
            "handler_implementation_version": n.handler_implementation_version,
            "service_release_digest": n.service_release_digest,
            "asserted_capability": None
            if n.asserted_capability is None
            else n.asserted_capability.to_dict(),
        }

    @classmethod
    def parse(
        cls, m: Mapping[str, object], path: str, issues: list[Diagnostic]
    ) -> HandlerBinding | None:
        """Read the JSON shape at ``path``, appending shape issues."""
        p.reject_unknown_keys(m, _HANDLER_KEYS, path, issues)
        owner = p.get_str(m, "owner_registration_id", path, issues, required=True)
        ref = p.get_str(m, "handler_ref", path, issues, required=True)
        version = p.get_str(m, "handler_implementation_version", path, issues, required=False)
        release = p.get_str(m, "service_release_digest", path, issues, required=False)
        raw_cap = m.get("asserted_capability")
        cap = None
        if raw_cap is not None:
            cap = CapabilityDescriptor.parse(raw_cap, p.at(path, "asserted_capability"), issues)
            if cap is None:
                return None
        if owner is None or ref is None:
            return None
        return cls(owner, ref, version, release, cap)


_HANDLER_KEYS = frozenset(
    {
        "owner_registration_id",
        "handler_ref",
        "handler_implementation_version",
        "service_release_digest",
        "asserted_capability",
    }
)
_SUBMISSION_KEYS = frozenset({"action_type", "owner", "descriptor", "handler_binding"})


def _prefixed(entry: str, prefix: str, issues: list[Diagnostic]) -> list[CatalogDiagnostic]:
    return [CatalogDiagnostic.from_diagnostic(entry, d, prefix=prefix) for d in issues]


@dataclass(frozen=True, slots=True)
class CatalogEntrySubmission:
    """One source's submission of an action type to an open generation (§8.2 step 2).

    ``handler_binding`` is ``None`` for a contract-only entry (for example a reserved
    platform action whose handler is not bound yet); such an entry is sealed but never
    executable.
    """

    action_type: str
    owner: ActionOwner
    descriptor: CapabilityDescriptor
    handler_binding: HandlerBinding | None = None

    @property
    def contract_only(self) -> bool:
        """True when the submission carries no handler binding."""
        return self.handler_binding is None

    @property
    def entry_name(self) -> str:
        """The action type as diagnostics name it (normalized when possible)."""
        return normalize_action_type(self.action_type) if isinstance(self.action_type, str) else ""

    def validate(self) -> list[CatalogDiagnostic]:
        """Every field issue; each names the entry and the field path."""
        entry = self.entry_name
        out = _prefixed(entry, "", check_action_type(entry, "action_type"))
        if not isinstance(self.owner, ActionOwner):
            out.append(
                CatalogDiagnostic(entry, "owner", DiagnosticCode.MISSING_FIELD, "owner is required")
            )
        else:
            out += _prefixed(entry, "owner", self.owner.validate())
        if not isinstance(self.descriptor, CapabilityDescriptor):
            out.append(
                CatalogDiagnostic(
                    entry, "descriptor", DiagnosticCode.MISSING_FIELD, "descriptor is required"
                )
            )
        else:
            out += _prefixed(entry, "descriptor", self.descriptor.validate())
        if self.handler_binding is not None:
            out += _prefixed(entry, "handler_binding", self.handler_binding.validate())
        return out

    def to_dict(self) -> dict[str, object]:
        """JSON shape (normalized)."""
        hb = self.handler_binding
        return {
            "action_type": self.entry_name,
            "owner": self.owner.to_dict(),
            "descriptor": self.descriptor.to_dict(),
            "handler_binding": None if hb is None else hb.to_dict(),
        }

    @classmethod
    def from_dict(cls, raw: object) -> CatalogEntrySubmission:
        """Parse the JSON shape; field validation is left to :meth:`validate`/the builder.

        Raises:
            DomainValidationError: shape issues (missing fields, wrong types, unknown enum
                values, unknown keys), as :class:`CatalogDiagnostic` values.
        """
        issues: list[Diagnostic] = []
        m = p.expect_mapping(raw, "", issues)
        entry = ""
        sub: CatalogEntrySubmission | None = None
        if m is not None:
            p.reject_unknown_keys(m, _SUBMISSION_KEYS, "", issues)
            action_type = p.get_str(m, "action_type", "", issues, required=True)
            entry = normalize_action_type(action_type) if action_type is not None else ""
            owner = None
            om = m.get("owner")
            if om is None:
                issues.append(
                    Diagnostic("owner", DiagnosticCode.MISSING_FIELD, "owner is required")
                )
            elif (om_map := p.expect_mapping(om, "owner", issues)) is not None:
                p.reject_unknown_keys(
                    om_map, frozenset({"kind", "registration_id"}), "owner", issues
                )
                kind = p.get_enum(om_map, "kind", OwnerKind, "owner", issues)
                reg = p.get_str(om_map, "registration_id", "owner", issues, required=True)
                owner = None if kind is None or reg is None else ActionOwner(kind, reg)
            descriptor = None
            if m.get("descriptor") is None:
                issues.append(
                    Diagnostic("descriptor", DiagnosticCode.MISSING_FIELD, "descriptor is required")
                )
            else:
                descriptor = CapabilityDescriptor.parse(m["descriptor"], "descriptor", issues)
            handler = None
            if m.get("handler_binding") is not None:
                hm = p.expect_mapping(m["handler_binding"], "handler_binding", issues)
                handler = (
                    None if hm is None else HandlerBinding.parse(hm, "handler_binding", issues)
                )
            if (
                not issues
                and action_type is not None
                and owner is not None
                and descriptor is not None
            ):
                sub = cls(action_type, owner, descriptor, handler)
        if sub is None or issues:
            raise DomainValidationError(
                "catalog entry submission",
                tuple(CatalogDiagnostic.from_diagnostic(entry, d) for d in issues),
            )
        return sub


def compute_binding_fingerprint(
    handler: HandlerBinding, descriptor_digest: DescriptorDigest
) -> BindingFingerprint:
    """``BindingFingerprint`` of a (normalized) handler binding over a descriptor digest."""
    h = handler.normalized()
    return BindingFingerprint(
        versioned_digest(
            BINDING_FINGERPRINT_KIND,
            {
                "owner_registration_id": h.owner_registration_id,
                "handler_ref": h.handler_ref,
                "handler_implementation_version": h.handler_implementation_version,
                "service_release_digest": h.service_release_digest,
                "descriptor_digest": descriptor_digest,
            },
        )
    )


def compute_entry_digest(
    action_type: str,
    owner: ActionOwner,
    descriptor_digest: DescriptorDigest,
    handler: HandlerBinding | None,
    fingerprint: BindingFingerprint | None,
) -> EntryDigest:
    """``EntryDigest`` over the normalized complete entry including its fingerprint."""
    handler_part: dict[str, object] | None = None
    if handler is not None:
        h = handler.normalized()
        cap = h.asserted_capability
        handler_part = {
            "owner_registration_id": h.owner_registration_id,
            "handler_ref": h.handler_ref,
            "handler_implementation_version": h.handler_implementation_version,
            "service_release_digest": h.service_release_digest,
            "asserted_capability_digest": None if cap is None else cap.digest(),
        }
    return EntryDigest(
        versioned_digest(
            ENTRY_DIGEST_KIND,
            {
                "action_type": normalize_action_type(action_type),
                "owner": owner.to_dict(),
                "descriptor_digest": descriptor_digest,
                "contract_only": handler is None,
                "handler_binding": handler_part,
                "binding_fingerprint": fingerprint,
            },
        )
    )


@dataclass(frozen=True, slots=True)
class CatalogEntry:
    """One admitted, normalized entry with its digest chain (§8.1 "binds, in one record")."""

    action_type: ActionType
    owner: ActionOwner
    descriptor: CapabilityDescriptor
    descriptor_digest: DescriptorDigest
    handler_binding: HandlerBinding | None
    binding_fingerprint: BindingFingerprint | None
    entry_digest: EntryDigest

    @property
    def executable(self) -> bool:
        """True when a handler is bound; contract-only entries never dispatch."""
        return self.handler_binding is not None

    @property
    def handler_ref(self) -> HandlerRef | None:
        """Normalized handler reference, if bound."""
        return (
            None if self.handler_binding is None else HandlerRef(self.handler_binding.handler_ref)
        )

    @classmethod
    def from_submission(cls, submission: CatalogEntrySubmission) -> CatalogEntry:
        """Normalize a (validated) submission and compute its digest chain."""
        action_type = ActionType(normalize_action_type(submission.action_type))
        descriptor = submission.descriptor.normalized()
        ddigest = descriptor.digest()
        handler = (
            None if submission.handler_binding is None else submission.handler_binding.normalized()
        )
        fingerprint = None if handler is None else compute_binding_fingerprint(handler, ddigest)
        return cls(
            action_type=action_type,
            owner=submission.owner,
            descriptor=descriptor,
            descriptor_digest=ddigest,
            handler_binding=handler,
            binding_fingerprint=fingerprint,
            entry_digest=compute_entry_digest(
                action_type, submission.owner, ddigest, handler, fingerprint
            ),
        )

    def as_submission(self) -> CatalogEntrySubmission:
        """The submission this entry normalizes."""
        return CatalogEntrySubmission(
            self.action_type, self.owner, self.descriptor, self.handler_binding
        )

    def verify(self) -> list[CatalogDiagnostic]:
        """Recompute the digest chain; one ``digest_mismatch`` per differing digest."""
        fresh = CatalogEntry.from_submission(self.as_submission())
        return [
            CatalogDiagnostic(
                self.action_type,
                name,
                DiagnosticCode.DIGEST_MISMATCH,
                f"stored {name} {getattr(self, name)!r} != recomputed {getattr(fresh, name)!r}",
            )
            for name in ("descriptor_digest", "binding_fingerprint", "entry_digest")
            if getattr(self, name) != getattr(fresh, name)
        ]

    def to_dict(self) -> dict[str, object]:
        """EntriesPayload item: the submission shape plus its digests."""
        out = self.as_submission().to_dict()
        out.update(
            descriptor_digest=self.descriptor_digest,
            binding_fingerprint=self.binding_fingerprint,
            entry_digest=self.entry_digest,
        )
        return out

    @classmethod
    def from_dict(cls, raw: object) -> CatalogEntry:
        """Read an EntriesPayload item and verify every stored digest.

        Raises:
            DomainValidationError: shape or field issues, or a digest mismatch.
        """
        issues: list[Diagnostic] = []
        m = p.expect_mapping(raw, "", issues)
        if m is None:
            raise DomainValidationError(
                "catalog entry", tuple(CatalogDiagnostic.from_diagnostic("", d) for d in issues)
            )
        digests = {
            k: p.get_str(m, k, "", issues, required=k != "binding_fingerprint")
            for k in ("descriptor_digest", "binding_fingerprint", "entry_digest")
        }
        body = {k: v for k, v in m.items() if k not in digests}
        try:
            sub = CatalogEntrySubmission.from_dict(body)
        except DomainValidationError as exc:
            raise DomainValidationError("catalog entry", exc.issues) from exc
        found = sub.validate()
        entry = sub.entry_name
        found += [CatalogDiagnostic.from_diagnostic(entry, d) for d in issues]
        if found:
            raise DomainValidationError("catalog entry", tuple(found))
        fresh = cls.from_submission(sub)
        stored = replace(
            fresh,
            descriptor_digest=DescriptorDigest(digests["descriptor_digest"] or ""),
            binding_fingerprint=(
                None
                if digests["binding_fingerprint"] is None
                else BindingFingerprint(digests["binding_fingerprint"])
            ),
            entry_digest=EntryDigest(digests["entry_digest"] or ""),
        )
        mismatches = stored.verify()
        if mismatches:
            raise DomainValidationError("catalog entry", tuple(mismatches))
        return stored
