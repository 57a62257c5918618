"""An in-process :class:`runtime_svc.catalog_client.CatalogPort` over compiler JSON documents,
for tests that drive :class:`runtime_svc.definitions.DefinitionService` directly."""

from __future__ import annotations

import copy
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from runtime_svc.definitions.inputs import CatalogSnapshot
from services.auth import TrustedRuntimeWorkScope
from services.digest import versioned_digest
from services.errors import NotFoundError
from tests.integration.definitions.catalog_protos import read_input


@dataclass
class MemoryCatalog:
    """Sealed generations and views by complete scope; records references."""

    snapshots: dict[tuple[TrustedRuntimeWorkScope, str], CatalogSnapshot] = field(
        default_factory=dict
    )
    references: set[tuple[TrustedRuntimeWorkScope, str, str]] = field(default_factory=set)

    def publish(
        self,
        org_id: str,
        *,
        subscriptions: Sequence[Mapping[str, Any]] | None = None,
        schema_generation: int = 1,
        app: str = "inst-1",
        capability: str = "cap-flow",
    ) -> tuple[TrustedRuntimeWorkScope, CatalogSnapshot]:
        """The corpus view and entries under a fresh binding of ``org_id``."""
        view = copy.deepcopy(read_input("metadata_view.json"))
        if subscriptions is not None:
            view["trigger_subscriptions"] = [
                {"flow_version": None, "dispatch_order": 0, **s} for s in subscriptions
            ]
        view["objects"].append({"api_name": f"Gen{schema_generation}", "fields": []})
        view["digest"] = versioned_digest("runtime_metadata_view", {**view, "digest": None})
        binding = {
            "org_id": org_id,
            "app_installation_id": app,
            "runtime_capability_id": capability,
            "catalog_revision": 1,
            "schema_generation": schema_generation,
            "engine_generation": 1,
            "catalog_snapshot_digest": versioned_digest("catalog_snapshot", [org_id]),
            "metadata_view_digest": view["digest"],
        }
        binding["binding_digest"] = versioned_digest("runtime_work_binding", binding)
        scope = TrustedRuntimeWorkScope(org_id, app, capability, binding["binding_digest"])
        entries = read_input("catalog.json")["entries"]
        generation = {
            "org_id": org_id,
            "app_installation_id": app,
            "runtime_capability_id": capability,
            "binding_digest": binding["binding_digest"],
            "generation_id": f"gen-{uuid.uuid4().hex[:10]}",
            "catalog_digest": versioned_digest(
                "catalog", [binding["binding_digest"], sorted(e["entry_digest"] for e in entries)]
            ),
            "sealed": True,
        }
        snapshot = CatalogSnapshot(binding, generation, tuple(entries), view)
        self.snapshots[(scope, snapshot.generation_id)] = snapshot
        return scope, snapshot

    async def load_snapshot(
        self, scope: TrustedRuntimeWorkScope, generation_id: str, catalog_digest: str
    ) -> CatalogSnapshot:
        snapshot = self.snapshots.get((scope, generation_id))
        if snapshot is None or snapshot.catalog_digest != catalog_digest:
            raise NotFoundError("CatalogGeneration", generation_id)
        return snapshot

    async def load_metadata_view(
        self, scope: TrustedRuntimeWorkScope, view_digest: str
    ) -> Mapping[str, Any] | None:
        for (s, _), snap in self.snapshots.items():
            if s.org_id == scope.org_id and snap.metadata_view_digest == view_digest:
                return snap.metadata_view
        return None

    async def register_plan_references(
        self,
        scope: TrustedRuntimeWorkScope,
        plan_id: str,
        generation_id: str,
        catalog_digest: str,
        view_digest: str,
    ) -> None:
        self.references.add((scope, f"generation:{generation_id}", plan_id))
        self.references.add((scope, f"view:{view_digest}", plan_id))

    async def release_plan_references(
        self,
        scope: TrustedRuntimeWorkScope,
        plan_id: str,
        generation_id: str,
        catalog_digest: str,
        view_digest: str,
    ) -> None:
        self.references.discard((scope, f"generation:{generation_id}", plan_id))
        self.references.discard((scope, f"view:{view_digest}", plan_id))
