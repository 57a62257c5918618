"""Diagnostics shared by the catalog domain: one issue shape, one code set, one error.

Validation in this package follows the "collect every issue, then fail once" rule:
``validate()`` methods *return* a list of issues; ``from_dict`` constructors raise one
:class:`DomainValidationError` carrying all of them. Decisions of the generation builder
(:mod:`catalog_svc.domain.generation`) are values that carry issues, never exceptions.

:class:`DomainValidationError` is a plain ``ValueError`` because pure code does not import
the service kernel; the API layer maps it to ``services.errors.InvalidArgumentError``
(``field_path`` = the first issue's path).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

__all__ = [
    "CONFLICT_CODES",
    "CatalogDiagnostic",
    "Diagnostic",
    "DiagnosticCode",
    "DomainValidationError",
]


class DiagnosticCode(StrEnum):
    """Stable machine codes of every issue the catalog domain reports.

    The value is the wire form (lower snake case) sent as ``ErrorDetail.code`` and stored
    as a generation's rejection reason.
    """

    # Shape and field validation: the submission or artifact is refused, nothing recorded.
    MISSING_FIELD = "missing_field"
    UNKNOWN_FIELD = "unknown_field"
    INVALID_TYPE = "invalid_type"
    UNKNOWN_ENUM_VALUE = "unknown_enum_value"
    INVALID_FORMAT = "invalid_format"
    OUT_OF_RANGE = "out_of_range"
    INCONSISTENT = "inconsistent"
    DUPLICATE_NAME = "duplicate_name"
    DANGLING_REFERENCE = "dangling_reference"
    UNSUPPORTED_VERSION = "unsupported_version"
    UNDECLARED_INPUT = "undeclared_input"
    VIEW_MISMATCH = "view_mismatch"
    DIGEST_MISMATCH = "digest_mismatch"
    # §8.3 conflict policy: each one rejects the entire generation.
    OWNER_CONFLICT = "owner_conflict"
    DESCRIPTOR_CONFLICT = "descriptor_conflict"
    HANDLER_REF_CONFLICT = "handler_ref_conflict"
    HANDLER_VERSION_CONFLICT = "handler_version_conflict"
    HANDLER_BINDING_CONFLICT = "handler_binding_conflict"
    HANDLER_OWNER_MISMATCH = "handler_owner_mismatch"
    PLATFORM_OWNED_OVERRIDE = "platform_owned_override"
    CAPABILITY_BROADENED = "capability_broadened"
    SCOPE_MISMATCH = "scope_mismatch"
    # Lifecycle: the generation cannot change any more.
    GENERATION_SEALED = "generation_sealed"
    GENERATION_REJECTED = "generation_rejected"


#: Codes that, when a submission triggers them, reject the entire generation (§8.3).
CONFLICT_CODES: frozenset[DiagnosticCode] = frozenset(
    {
        DiagnosticCode.OWNER_CONFLICT,
        DiagnosticCode.DESCRIPTOR_CONFLICT,
        DiagnosticCode.HANDLER_REF_CONFLICT,
        DiagnosticCode.HANDLER_VERSION_CONFLICT,
        DiagnosticCode.HANDLER_BINDING_CONFLICT,
        DiagnosticCode.HANDLER_OWNER_MISMATCH,
        DiagnosticCode.PLATFORM_OWNED_OVERRIDE,
        DiagnosticCode.CAPABILITY_BROADENED,
        DiagnosticCode.SCOPE_MISMATCH,
    }
)


@dataclass(frozen=True, slots=True)
class Diagnostic:
    """One issue about a value that is not a catalog entry (binding, metadata view).

    Attributes:
        path: dotted/indexed path of the offending field, e.g. ``objects[2].fields[0].type``.
        code: machine code.
        message: human explanation (safe to show to the caller).
    """

    path: str
    code: DiagnosticCode
    message: str


@dataclass(frozen=True, slots=True)
class CatalogDiagnostic:
    """One issue about a catalog entry submission or a generation.

    Attributes:
        entry: normalized action type of the entry (the raw value when it does not
            normalize; ``""`` for generation-level issues).
        field: path inside the submission, e.g. ``descriptor.fanout_bound.static_maximum``.
        code: machine code.
        message: human explanation (safe to show to the caller).
    """

    entry: str
    field: str
    code: DiagnosticCode
    message: str

    @classmethod
    def from_diagnostic(
        cls, entry: str, diagnostic: Diagnostic, *, prefix: str = ""
    ) -> CatalogDiagnostic:
        """Attach an entry name (and a path prefix) to a plain :class:`Diagnostic`."""
        field = diagnostic.path
        if prefix:
            field = f"{prefix}.{field}" if field else prefix
        return cls(entry, field, diagnostic.code, diagnostic.message)


class DomainValidationError(ValueError):
    """A value failed validation; ``issues`` holds every issue found (never empty)."""

    def __init__(self, what: str, issues: tuple[Diagnostic | CatalogDiagnostic, ...]) -> None:
        if not issues:
            raise ValueError("DomainValidationError needs at least one issue")
        self.issues = issues
        first = issues[0]
        where = first.path if isinstance(first, Diagnostic) else f"{first.entry}:{first.field}"
        more = f" (+{len(issues) - 1} more)" if len(issues) > 1 else ""
        super().__init__(f"invalid {what}: {where}: {first.message}{more}")
