"""``RuntimeWorkBinding`` and the trusted work scope derived from it (§7.1, §8.4, §10.0).

A binding is the complete, immutable metadata and work scope that plans, catalog
generations and durable Flow rows are bound to. Its canonical digest
(:data:`~catalog_svc.domain.ids.WORK_BINDING_DIGEST_KIND`) covers all eight fields, so a
difference in any one of them is a different binding. Two catalogs built from identical
entries under two bindings therefore never share a ``CatalogDigest`` (§8.4).

Integers (revision and generations) must be at least 1: proto3 sends an unset ``int64``
as ``0``, and "unset" must not silently mean "generation zero".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from services.digest import is_digest, versioned_digest

from . import _parse as p
from .diagnostics import Diagnostic, DiagnosticCode, DomainValidationError
from .ids import (
    INT64_MAX,
    METADATA_VIEW_DIGEST_KIND,
    WORK_BINDING_DIGEST_KIND,
    RuntimeWorkBindingDigest,
    check_identifier,
)

__all__ = ["RuntimeWorkBinding", "RuntimeWorkScope", "WorkScopeLike"]

_ID_FIELDS = ("org_id", "app_installation_id", "runtime_capability_id")
_INT_FIELDS = ("catalog_revision", "schema_generation", "engine_generation")
_DIGEST_FIELDS = ("catalog_snapshot_digest", "runtime_metadata_view_digest")
_FIELDS = frozenset(_ID_FIELDS + _INT_FIELDS + _DIGEST_FIELDS)


class WorkScopeLike(Protocol):
    """Anything carrying the four trusted work-scope components.

    ``services.auth.TrustedRuntimeWorkScope`` satisfies it, so the API layer can pass the
    scope it derived from the credential without converting it.
    """

    @property
    def org_id(self) -> str: ...

    @property
    def app_installation_id(self) -> str: ...

    @property
    def runtime_capability_id(self) -> str: ...

    @property
    def runtime_work_binding_digest(self) -> str: ...


@dataclass(frozen=True, slots=True)
class RuntimeWorkScope:
    """``TrustedRuntimeWorkScope`` (§10.0): org, installation, capability, binding digest."""

    org_id: str
    app_installation_id: str
    runtime_capability_id: str
    runtime_work_binding_digest: RuntimeWorkBindingDigest

    def mismatched_components(self, other: WorkScopeLike) -> list[str]:
        """Names of the components on which ``other`` differs (empty when equal)."""
        return [
            name
            for name in (
                "org_id",
                "app_installation_id",
                "runtime_capability_id",
                "runtime_work_binding_digest",
            )
            if getattr(self, name) != getattr(other, name)
        ]


@dataclass(frozen=True, slots=True)
class RuntimeWorkBinding:
    """The complete immutable metadata and work scope of compiled work (§7.1).

    Attributes:
        org_id: trusted org identity; never from Flow metadata (§10.0).
        app_installation_id: installation whose packs/bindings are assembled.
        runtime_capability_id: runtime execution-capability scope.
        catalog_revision: Catalog revision the metadata was read from (>= 1).
        schema_generation: object/field schema generation (>= 1).
        engine_generation: automation-engine generation (>= 1).
        catalog_snapshot_digest: digest of the Catalog snapshot (any versioned digest).
        runtime_metadata_view_digest: digest of the bound ``RuntimeMetadataView``
            (kind ``runtime_metadata_view``).
    """

    org_id: str
    app_installation_id: str
    runtime_capability_id: str
    catalog_revision: int
    schema_generation: int
    engine_generation: int
    catalog_snapshot_digest: str
    runtime_metadata_view_digest: str

    def validate(self) -> list[Diagnostic]:
        """Every issue with this binding; each names its field."""
        issues: list[Diagnostic] = []
        for name in _ID_FIELDS:
            issues += check_identifier(getattr(self, name), name, name)
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                issues.append(
                    Diagnostic(name, DiagnosticCode.INVALID_TYPE, f"{name} must be an integer")
                )
            elif not 1 <= value <= INT64_MAX:
                issues.append(
                    Diagnostic(
                        name,
                        DiagnosticCode.OUT_OF_RANGE,
                        f"{name} must be in [1, 2^63-1], got {value}",
                    )
                )
        for name, kind in (
            ("catalog_snapshot_digest", None),
            ("runtime_metadata_view_digest", METADATA_VIEW_DIGEST_KIND),
        ):
            value = getattr(self, name)
            if value is None or value == "":
                issues.append(Diagnostic(name, DiagnosticCode.MISSING_FIELD, f"{name} is required"))
            elif not isinstance(value, str):
                issues.append(
                    Diagnostic(name, DiagnosticCode.INVALID_TYPE, f"{name} must be a string")
                )
            elif not is_digest(value, kind):
                expected = f"<{kind}>" if kind else "<kind>"
                issues.append(
                    Diagnostic(
                        name,
                        DiagnosticCode.INVALID_FORMAT,
                        f"{name} must be a versioned digest {expected}/v<n>:sha256:<64 hex>",
                    )
                )
        return issues

    def to_dict(self) -> dict[str, object]:
        """JSON shape; also the canonical form that is digested."""
        return {
            "org_id": self.org_id,
            "app_installation_id": self.app_installation_id,
            "runtime_capability_id": self.runtime_capability_id,
            "catalog_revision": self.catalog_revision,
            "schema_generation": self.schema_generation,
            "engine_generation": self.engine_generation,
            "catalog_snapshot_digest": self.catalog_snapshot_digest,
            "runtime_metadata_view_digest": self.runtime_metadata_view_digest,
        }

    @classmethod
    def from_dict(cls, raw: object) -> RuntimeWorkBinding:
        """Parse and validate the JSON shape.

        Raises:
            DomainValidationError: every shape and field issue found.
        """
        issues: list[Diagnostic] = []
        m = p.expect_mapping(raw, "", issues)
        if m is None:
            raise DomainValidationError("runtime work binding", tuple(issues))
        p.reject_unknown_keys(m, _FIELDS, "", issues)
        strs = {k: p.get_str(m, k, "", issues, required=True) for k in _ID_FIELDS + _DIGEST_FIELDS}
        ints = {k: p.get_int(m, k, "", issues, required=True) for k in _INT_FIELDS}
        if issues:
            raise DomainValidationError("runtime work binding", tuple(issues))
        binding = cls(
            org_id=strs["org_id"] or "",
            app_installation_id=strs["app_installation_id"] or "",
            runtime_capability_id=strs["runtime_capability_id"] or "",
            catalog_revision=ints["catalog_revision"] or 0,
            schema_generation=ints["schema_generation"] or 0,
            engine_generation=ints["engine_generation"] or 0,
            catalog_snapshot_digest=strs["catalog_snapshot_digest"] or "",
            runtime_metadata_view_digest=strs["runtime_metadata_view_digest"] or "",
        )
        found = binding.validate()
        if found:
            raise DomainValidationError("runtime work binding", tuple(found))
        return binding

    def digest(self) -> RuntimeWorkBindingDigest:
        """Canonical ``RuntimeWorkBindingDigest`` over all eight fields."""
        return RuntimeWorkBindingDigest(versioned_digest(WORK_BINDING_DIGEST_KIND, self.to_dict()))

    def work_scope(self) -> RuntimeWorkScope:
        """The ``TrustedRuntimeWorkScope`` this binding defines."""
        return RuntimeWorkScope(
            org_id=self.org_id,
            app_installation_id=self.app_installation_id,
            runtime_capability_id=self.runtime_capability_id,
            runtime_work_binding_digest=self.digest(),
        )
