"""Values the catalog repository reads and writes: domain values plus storage facts.

The repository never returns rows; it returns these frozen records, whose domain parts
(:class:`~catalog_svc.domain.RuntimeWorkBinding`, :class:`~catalog_svc.domain.GenerationDraft`,
...) were rebuilt and digest-verified from the stored payloads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import TypeVar

from catalog_svc.domain import (
    CatalogEntry,
    GenerationDraft,
    RuntimeHandlerTuple,
    RuntimeMetadataView,
    RuntimeWorkBinding,
    RuntimeWorkBindingDigest,
    RuntimeWorkScope,
)

__all__ = [
    "BindingRecord",
    "Encoder",
    "EntryPage",
    "EntryRecord",
    "GenerationRecord",
    "HolderKind",
    "InstallationScope",
    "ReferenceIdentity",
    "ReferenceRecord",
    "ReferentKind",
    "ReleaseRecord",
    "ViewRecord",
]

T = TypeVar("T")

#: Serializes a mutation's fresh result into its response bytes inside the mutation's
#: transaction; ``None`` = record no response (the service raises a refusal for this
#: outcome after the commit, and a retry decides again).
Encoder = Callable[[T], bytes | None]


@dataclass(frozen=True, slots=True)
class InstallationScope:
    """Trusted org plus app installation: the scope of a metadata view."""

    org_id: str
    app_installation_id: str


class ReferentKind(StrEnum):
    """What a retention reference holds (stored code)."""

    CATALOG_GENERATION = "CATALOG_GENERATION"
    METADATA_VIEW = "METADATA_VIEW"


class HolderKind(StrEnum):
    """Who holds a retention reference (stored code, §7.4, §8.4)."""

    PLAN = "PLAN"
    FLOW_RUN = "FLOW_RUN"
    DIAGNOSTIC = "DIAGNOSTIC"


@dataclass(frozen=True, slots=True)
class BindingRecord:
    """A registered ``RuntimeWorkBinding``."""

    binding: RuntimeWorkBinding
    digest: RuntimeWorkBindingDigest
    registered_at: datetime

    @property
    def scope(self) -> RuntimeWorkScope:
        """The complete trusted work scope the binding defines."""
        return RuntimeWorkScope(
            self.binding.org_id,
            self.binding.app_installation_id,
            self.binding.runtime_capability_id,
            self.digest,
        )


@dataclass(frozen=True, slots=True)
class ViewRecord:
    """A metadata view as one installation published it."""

    scope: InstallationScope
    digest: str
    schema_generation: int
    view: RuntimeMetadataView
    created_at: datetime


@dataclass(frozen=True, slots=True)
class EntryRecord:
    """One admitted entry of a generation."""

    generation_id: str
    entry: CatalogEntry
    created_at: datetime


@dataclass(frozen=True, slots=True)
class GenerationRecord:
    """A stored generation rebuilt as a domain draft, plus its storage facts."""

    draft: GenerationDraft
    state_version: int
    created_at: datetime
    sealed_at: datetime | None
    entry_created_at: Mapping[str, datetime] = field(default_factory=dict)

    def entry_record(self, entry: CatalogEntry) -> EntryRecord:
        """``entry`` of this generation with its submission time."""
        created = self.entry_created_at.get(entry.action_type, self.created_at)
        return EntryRecord(self.draft.generation_id, entry, created)


@dataclass(frozen=True, slots=True)
class EntryPage:
    """One page of a sealed generation's entries, in action-type order."""

    generation: GenerationRecord
    entries: tuple[EntryRecord, ...]
    next_after: str | None


@dataclass(frozen=True, slots=True)
class ReferenceIdentity:
    """Identity of a retention reference within a work scope."""

    referent_kind: ReferentKind
    referent_id: str
    holder_kind: HolderKind
    holder_id: str


@dataclass(frozen=True, slots=True)
class ReferenceRecord:
    """A stored retention reference.

    ``catalog_digest`` is the sealed digest of a referenced generation (``None`` for a
    metadata view).
    """

    identity: ReferenceIdentity
    catalog_digest: str | None
    expires_at: datetime | None
    created_at: datetime


@dataclass(frozen=True, slots=True)
class ReleaseRecord:
    """What one runtime binary release published within a work scope (§8.4)."""

    runtime_release_id: str
    supported_capability_version: int
    tuples: tuple[RuntimeHandlerTuple, ...]
    published_at: datetime
