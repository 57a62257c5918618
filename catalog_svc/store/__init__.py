"""Persistence of the catalog service: one repository over the catalog schema."""

from __future__ import annotations

from ._requests import Encoder
from ._rows import ArtifactIntegrityError
from .records import (
    BindingRecord,
    EntryPage,
    EntryRecord,
    GenerationRecord,
    HolderKind,
    InstallationScope,
    MutationOutcome,
    ReferenceIdentity,
    ReferenceRecord,
    ReferentKind,
    ReleaseRecord,
    RequestKey,
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
    "MutationOutcome",
    "ReferenceIdentity",
    "ReferenceRecord",
    "ReferentKind",
    "ReleaseRecord",
    "RequestKey",
    "SealResult",
    "SubmitResult",
    "ViewRecord",
]
