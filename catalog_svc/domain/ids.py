"""Identifier types, their grammars and normalization, and the digest kinds.

Every digest in the catalog domain is ``services.digest.versioned_digest(kind, value)``
over a canonical dict; the kinds are listed here so that the repository, the proto
mapping and the runtime agree on them:

=============================  ===============================  =====================
Digest                          kind                             version
=============================  ===============================  =====================
RuntimeWorkBindingDigest        ``runtime_work_binding``         1
RuntimeMetadataViewDigest       ``runtime_metadata_view``        1
capability-descriptor digest    ``capability_descriptor``        = ``CONTRACT_VERSION``
BindingFingerprint              ``binding_fingerprint``          1
EntryDigest                     ``catalog_entry``                1
CatalogDigest                   ``catalog``                      1
=============================  ===============================  =====================

The descriptor digest is versioned by the neutral descriptor schema version
(``ContractVersion``, §8.4), so a schema change can never produce a digest equal to one
of the previous schema.
"""

from __future__ import annotations

import re
from typing import NewType

from .diagnostics import Diagnostic, DiagnosticCode

__all__ = [
    "BINDING_FINGERPRINT_KIND",
    "CATALOG_DIGEST_KIND",
    "CONTRACT_VERSION",
    "DESCRIPTOR_DIGEST_KIND",
    "ENTRY_DIGEST_KIND",
    "INT64_MAX",
    "METADATA_VIEW_DIGEST_KIND",
    "SUPPORTED_CONTRACT_VERSIONS",
    "WORK_BINDING_DIGEST_KIND",
    "ActionType",
    "BindingFingerprint",
    "CatalogDigest",
    "CatalogGenerationId",
    "DescriptorDigest",
    "EntryDigest",
    "HandlerRef",
    "RuntimeMetadataViewDigest",
    "RuntimeWorkBindingDigest",
    "check_action_type",
    "check_generation_id",
    "check_handler_ref",
    "check_identifier",
    "normalize_action_type",
    "normalize_handler_ref",
]

RuntimeWorkBindingDigest = NewType("RuntimeWorkBindingDigest", str)
RuntimeMetadataViewDigest = NewType("RuntimeMetadataViewDigest", str)
DescriptorDigest = NewType("DescriptorDigest", str)
BindingFingerprint = NewType("BindingFingerprint", str)
EntryDigest = NewType("EntryDigest", str)
CatalogDigest = NewType("CatalogDigest", str)
CatalogGenerationId = NewType("CatalogGenerationId", str)
ActionType = NewType("ActionType", str)
HandlerRef = NewType("HandlerRef", str)

WORK_BINDING_DIGEST_KIND = "runtime_work_binding"
METADATA_VIEW_DIGEST_KIND = "runtime_metadata_view"
DESCRIPTOR_DIGEST_KIND = "capability_descriptor"
BINDING_FINGERPRINT_KIND = "binding_fingerprint"
ENTRY_DIGEST_KIND = "catalog_entry"
CATALOG_DIGEST_KIND = "catalog"

#: Neutral capability-descriptor schema version this code writes (§8.4 ContractVersion).
CONTRACT_VERSION = 1
#: Descriptor schema versions this code can read.
SUPPORTED_CONTRACT_VERSIONS: frozenset[int] = frozenset({CONTRACT_VERSION})

INT64_MAX = 2**63 - 1

# Action type: dot-separated lower-case segments, e.g. ``core.update_records`` or
# ``acme-billing.send_invoice``. Normalization is strip + ASCII lower-casing, so two
# spellings that differ only in case or surrounding blanks are the same action type
# and can never become two entries of one generation.
_ACTION_TYPE_RE = re.compile(r"^[a-z][a-z0-9_-]*(?:\.[a-z][a-z0-9_-]*)*$")
_ACTION_TYPE_MAX = 200
# Handler reference: a stable symbolic name (``python:acme.mail.handlers:send``), case
# sensitive. Never a process address or a function repr (§8.1).
_HANDLER_REF_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:/-]*$")
_HANDLER_REF_MAX = 256
_ADDRESS_RE = re.compile(r"0x[0-9a-fA-F]{4,}")
# Org / installation / capability / registration identities.
_IDENTIFIER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:@/+=-]*$")
_IDENTIFIER_MAX = 200
_GENERATION_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")
_GENERATION_ID_MAX = 128


def normalize_action_type(raw: str) -> str:
    """Normalize an action type (strip, ASCII lower-case); does not validate."""
    return raw.strip().lower() if raw.isascii() else raw.strip()


def normalize_handler_ref(raw: str) -> str:
    """Normalize a handler reference (strip surrounding blanks); does not validate."""
    return raw.strip()


def check_action_type(value: object, path: str) -> list[Diagnostic]:
    """Issues with an already-normalized action type."""
    if value is None or value == "":
        return [Diagnostic(path, DiagnosticCode.MISSING_FIELD, "action type is required")]
    if not isinstance(value, str):
        return [Diagnostic(path, DiagnosticCode.INVALID_TYPE, "action type must be a string")]
    if len(value) > _ACTION_TYPE_MAX or not _ACTION_TYPE_RE.match(value):
        return [
            Diagnostic(
                path,
                DiagnosticCode.INVALID_FORMAT,
                f"action type {value!r} must be dot-separated segments of [a-z][a-z0-9_-]* "
                f"(at most {_ACTION_TYPE_MAX} characters)",
            )
        ]
    return []


def check_handler_ref(value: object, path: str) -> list[Diagnostic]:
    """Issues with an already-normalized handler reference."""
    if value is None or value == "":
        return [Diagnostic(path, DiagnosticCode.MISSING_FIELD, "handler_ref is required")]
    if not isinstance(value, str):
        return [Diagnostic(path, DiagnosticCode.INVALID_TYPE, "handler_ref must be a string")]
    if _ADDRESS_RE.search(value):
        return [
            Diagnostic(
                path,
                DiagnosticCode.INVALID_FORMAT,
                "handler_ref looks like a process address; persisted identity must be a "
                "stable symbolic name (§8.1)",
            )
        ]
    if len(value) > _HANDLER_REF_MAX or not _HANDLER_REF_RE.match(value):
        return [
            Diagnostic(
                path,
                DiagnosticCode.INVALID_FORMAT,
                f"handler_ref {value!r} must match [A-Za-z_][A-Za-z0-9_.:/-]* "
                f"(at most {_HANDLER_REF_MAX} characters)",
            )
        ]
    return []


def check_identifier(value: object, path: str, what: str) -> list[Diagnostic]:
    """Issues with an org/installation/capability/registration identity."""
    if value is None or value == "":
        return [Diagnostic(path, DiagnosticCode.MISSING_FIELD, f"{what} is required")]
    if not isinstance(value, str):
        return [Diagnostic(path, DiagnosticCode.INVALID_TYPE, f"{what} must be a string")]
    if len(value) > _IDENTIFIER_MAX or not _IDENTIFIER_RE.match(value):
        return [
            Diagnostic(
                path,
                DiagnosticCode.INVALID_FORMAT,
                f"{what} {value!r} must match [A-Za-z0-9][A-Za-z0-9_.:@/+=-]* "
                f"(at most {_IDENTIFIER_MAX} characters)",
            )
        ]
    return []


def check_generation_id(value: object, path: str = "catalog_generation_id") -> list[Diagnostic]:
    """Issues with a catalog generation id."""
    if value is None or value == "":
        return [Diagnostic(path, DiagnosticCode.MISSING_FIELD, "generation id is required")]
    if not isinstance(value, str):
        return [Diagnostic(path, DiagnosticCode.INVALID_TYPE, "generation id must be a string")]
    if len(value) > _GENERATION_ID_MAX or not _GENERATION_ID_RE.match(value):
        return [
            Diagnostic(
                path,
                DiagnosticCode.INVALID_FORMAT,
                f"generation id {value!r} must match [A-Za-z0-9][A-Za-z0-9_.:-]* "
                f"(at most {_GENERATION_ID_MAX} characters)",
            )
        ]
    return []
