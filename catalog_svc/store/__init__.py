"""Persistence of the catalog service: one repository over the catalog schema."""

from __future__ import annotations

from ._rows import ArtifactIntegrityError
from .records import (
    BindingRecord,
    Encoder,
    EntryPage,
    EntryRecord,
    GenerationRecord,
    HolderKind,
    InstallationScope,
    ReferenceIdentity,
    ReferenceRecord,
    ReferentKind,
    ReleaseRecord,
    ViewRecord,
)
from .repository import CatalogRepository, SealResult, SubmitResult

__all__ = [
    "ArtifactIntegrityError",
    "BindingRecord",
    "CatalogRepository",
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
    "SealResult",
    "SubmitResult",
    "ViewRecord",
]
