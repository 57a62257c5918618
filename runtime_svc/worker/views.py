"""Where the worker gets the record view of a plan's work scope."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

from runtime_svc.compiler import MetadataViewInput
from runtime_svc.records import RecordView
from services.auth import TrustedRuntimeWorkScope

__all__ = ["FixedViews", "RecordViewSource"]


class RecordViewSource(Protocol):
    """Structural twin of ``runtime_svc.api.records.RecordViewSource`` (the catalog-backed
    ``CatalogRecordViews`` satisfies it)."""

    async def view_for(self, scope: TrustedRuntimeWorkScope) -> RecordView:
        """The view bound to ``scope``."""
        ...


class FixedViews:
    """One view for every scope (tests, benches, single-view dev stacks)."""

    def __init__(self, view: RecordView) -> None:
        self._view = view

    async def view_for(self, scope: TrustedRuntimeWorkScope) -> RecordView:
        return self._view

    @classmethod
    def from_file(cls, path: str) -> FixedViews:
        """A ``MetadataViewInput`` JSON document (the compiler-input shape)."""
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
        return cls(RecordView.from_metadata_view(MetadataViewInput.from_dict(doc)))
