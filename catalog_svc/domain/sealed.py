"""The sealed ``FlowActionCatalogGeneration`` artifact and its ``CatalogDigest`` (§8.4).

``CatalogDigest = versioned_digest("catalog", {runtime_work_binding_digest,
entry_digests: sorted})`` — exactly the spec's inputs (§8.1 step 4, §8.4): the complete
binding digest, so identical entries under another org, installation, capability or
binding never alias, and the sorted entry digests, so submission order is irrelevant.
The generation id is deliberately *not* hashed: the digest is the content identity,
while every read key pairs it with the generation id and the full trusted scope. The
descriptor schema version (``ContractVersion``) is committed through every descriptor
digest, whose digest version it is.

:meth:`SealedGeneration.to_dict` is the persisted ``EntriesPayload`` plus identity;
:meth:`SealedGeneration.from_dict` re-verifies every digest, so an artifact read back
from storage is never trusted blindly and a generation is never rebuilt from current
pack metadata.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from services.digest import versioned_digest

from . import _parse as p
from .binding import RuntimeWorkBinding, RuntimeWorkScope
from .diagnostics import CatalogDiagnostic, Diagnostic, DiagnosticCode, DomainValidationError
from .entry import CatalogEntry
from .ids import (
    CATALOG_DIGEST_KIND,
    SUPPORTED_CONTRACT_VERSIONS,
    CatalogDigest,
    CatalogGenerationId,
    RuntimeWorkBindingDigest,
    check_generation_id,
    normalize_action_type,
)

__all__ = ["SealedGeneration", "compute_catalog_digest"]


def compute_catalog_digest(
    binding_digest: RuntimeWorkBindingDigest, entry_digests: Iterable[str]
) -> CatalogDigest:
    """``CatalogDigest`` over the binding digest and the sorted entry digests."""
    return CatalogDigest(
        versioned_digest(
            CATALOG_DIGEST_KIND,
            {"runtime_work_binding_digest": binding_digest, "entry_digests": sorted(entry_digests)},
        )
    )


_KEYS = frozenset(
    {
        "runtime_work_binding",
        "runtime_work_binding_digest",
        "catalog_generation_id",
        "contract_version",
        "catalog_digest",
        "entries",
    }
)


@dataclass(frozen=True, slots=True)
class SealedGeneration:
    """An immutable sealed generation: identity, digest and entries sorted by action type."""

    binding: RuntimeWorkBinding
    binding_digest: RuntimeWorkBindingDigest
    generation_id: CatalogGenerationId
    contract_version: int
    catalog_digest: CatalogDigest
    entries: tuple[CatalogEntry, ...]

    @classmethod
    def build(
        cls,
        binding: RuntimeWorkBinding,
        generation_id: str,
        entries: Iterable[CatalogEntry],
        contract_version: int,
    ) -> SealedGeneration:
        """Sort ``entries`` and compute the catalog digest (entries must be admitted)."""
        ordered = tuple(sorted(entries, key=lambda e: e.action_type))
        bd = binding.digest()
        return cls(
            binding=binding,
            binding_digest=bd,
            generation_id=CatalogGenerationId(generation_id),
            contract_version=contract_version,
            catalog_digest=compute_catalog_digest(bd, (e.entry_digest for e in ordered)),
            entries=ordered,
        )

    @property
    def scope(self) -> RuntimeWorkScope:
        """The complete trusted scope the generation is keyed by."""
        return RuntimeWorkScope(
            self.binding.org_id,
            self.binding.app_installation_id,
            self.binding.runtime_capability_id,
            self.binding_digest,
        )

    def get_entry(self, action_type: str) -> CatalogEntry | None:
        """The entry of the (normalized) action type."""
        wanted = normalize_action_type(action_type)
        return next((e for e in self.entries if e.action_type == wanted), None)

    def verify(self) -> list[CatalogDiagnostic]:
        """Recompute everything: binding validity and digest, entry order and digests,
        catalog digest. Empty when the artifact is intact."""
        out = [
            CatalogDiagnostic.from_diagnostic("", d, prefix="runtime_work_binding")
            for d in self.binding.validate()
        ]
        out += [
            CatalogDiagnostic.from_diagnostic("", d)
            for d in check_generation_id(self.generation_id)
        ]
        if self.contract_version not in SUPPORTED_CONTRACT_VERSIONS:
            out.append(
                CatalogDiagnostic(
                    "",
                    "contract_version",
                    DiagnosticCode.UNSUPPORTED_VERSION,
                    f"{self.contract_version} unsupported",
                )
            )
        if self.binding_digest != self.binding.digest():
            out.append(
                CatalogDiagnostic(
                    "",
                    "runtime_work_binding_digest",
                    DiagnosticCode.DIGEST_MISMATCH,
                    "binding digest mismatch",
                )
            )
        names = [e.action_type for e in self.entries]
        if names != sorted(set(names)):
            out.append(
                CatalogDiagnostic(
                    "",
                    "entries",
                    DiagnosticCode.INCONSISTENT,
                    "entries must be unique and sorted by action type",
                )
            )
        for e in self.entries:
            out += e.verify()
        expected = compute_catalog_digest(
            self.binding.digest(), (e.entry_digest for e in self.entries)
        )
        if self.catalog_digest != expected:
            out.append(
                CatalogDiagnostic(
                    "", "catalog_digest", DiagnosticCode.DIGEST_MISMATCH, "catalog digest mismatch"
                )
            )
        return out

    def to_dict(self) -> dict[str, object]:
        """Persisted shape: identity, ``CatalogDigest`` and ``EntriesPayload``."""
        return {
            "runtime_work_binding": self.binding.to_dict(),
            "runtime_work_binding_digest": self.binding_digest,
            "catalog_generation_id": self.generation_id,
            "contract_version": self.contract_version,
            "catalog_digest": self.catalog_digest,
            "entries": [e.to_dict() for e in self.entries],
        }

    @classmethod
    def from_dict(cls, raw: object) -> SealedGeneration:
        """Read a persisted generation and verify every digest in it.

        Raises:
            DomainValidationError: shape issues or any digest mismatch.
        """
        issues: list[Diagnostic] = []
        m = p.expect_mapping(raw, "", issues)
        found: list[CatalogDiagnostic] = []
        if m is not None:
            p.reject_unknown_keys(m, _KEYS, "", issues)
            bd = p.get_str(m, "runtime_work_binding_digest", "", issues, required=True)
            gid = p.get_str(m, "catalog_generation_id", "", issues, required=True)
            cv = p.get_int(m, "contract_version", "", issues, required=True)
            cd = p.get_str(m, "catalog_digest", "", issues, required=True)
            binding: RuntimeWorkBinding | None = None
            try:
                binding = RuntimeWorkBinding.from_dict(m.get("runtime_work_binding"))
            except DomainValidationError as exc:
                found += [
                    CatalogDiagnostic.from_diagnostic("", d, prefix="runtime_work_binding")
                    for d in exc.issues
                    if isinstance(d, Diagnostic)
                ]
            entries: list[CatalogEntry] = []
            for raw_entry in p.get_list(m, "entries", "", issues):
                try:
                    entries.append(CatalogEntry.from_dict(raw_entry))
                except DomainValidationError as exc:
                    found += [d for d in exc.issues if isinstance(d, CatalogDiagnostic)]
            if (
                not issues
                and not found
                and binding is not None
                and bd
                and gid
                and cv is not None
                and cd
            ):
                gen = cls(
                    binding,
                    RuntimeWorkBindingDigest(bd),
                    CatalogGenerationId(gid),
                    cv,
                    CatalogDigest(cd),
                    tuple(entries),
                )
                found = gen.verify()
                if not found:
                    return gen
        found += [CatalogDiagnostic.from_diagnostic("", d) for d in issues]
        raise DomainValidationError("sealed catalog generation", tuple(found))
