"""An in-memory CatalogService that honours the proto contract the runtime relies on.

It serves GetGeneration, ListEntries (paged), GetMetadataView, GetWorkBinding,
RegisterReference and ReleaseReference over real gRPC with the real auth interceptor:
every read is keyed by the caller's complete trusted scope, and a lookup in another scope
answers NOT_FOUND exactly like a missing row. Tests add artifacts with :meth:`publish`.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.auth import current_identity
from services.digest import versioned_digest
from services.errors import FailedPreconditionError, NotFoundError
from services.proto import catalog_v1, common_v1
from tests.integration.definitions.catalog_protos import binding_digest, entry_proto, view_digest

ScopeKey = tuple[str, str, str, str]

PAGE_SIZE = 4  # small, so the runtime's paging is exercised


def _key(scope: Any) -> ScopeKey:
    return (
        scope.org_id,
        scope.app_installation_id,
        scope.runtime_capability_id,
        scope.runtime_work_binding_digest,
    )


@dataclass(frozen=True)
class Published:
    """What :meth:`FakeCatalog.publish` created."""

    scope: ScopeKey
    binding: Any
    view_digest: str
    generation_id: str
    catalog_digest: str

    def scope_proto(self) -> Any:
        return common_v1.TrustedRuntimeWorkScope(
            org_id=self.scope[0],
            app_installation_id=self.scope[1],
            runtime_capability_id=self.scope[2],
            runtime_work_binding_digest=self.scope[3],
        )


@dataclass
class FakeCatalog(catalog_v1.CatalogServiceServicer):  # type: ignore[misc]
    bindings: dict[ScopeKey, Any] = field(default_factory=dict)
    views: dict[tuple[str, str, str], Any] = field(default_factory=dict)
    generations: dict[tuple[ScopeKey, str], tuple[Any, list[Any]]] = field(default_factory=dict)
    references: set[tuple[ScopeKey, str, str]] = field(default_factory=set)
    released: list[tuple[ScopeKey, str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    # --- test-side publication -----------------------------------------------------------

    def publish(
        self,
        org_id: str,
        view: Any,
        entries: Sequence[Mapping[str, Any]],
        *,
        app: str = "inst-1",
        capability: str = "cap-flow",
        catalog_revision: int = 1,
        sealed: bool = True,
        generation_id: str | None = None,
    ) -> Published:
        """Publish ``view``, register its binding, seal one generation of ``entries``."""
        v = catalog_v1.MetadataView()
        v.CopyFrom(view)
        v.runtime_metadata_view_digest = view_digest(view)
        binding = common_v1.RuntimeWorkBinding(
            org_id=org_id,
            app_installation_id=app,
            runtime_capability_id=capability,
            catalog_revision=catalog_revision,
            schema_generation=v.schema_generation,
            engine_generation=1,
            catalog_snapshot_digest=versioned_digest(
                "catalog_snapshot", [org_id, catalog_revision]
            ),
            runtime_metadata_view_digest=v.runtime_metadata_view_digest,
        )
        scope = (org_id, app, capability, binding_digest(binding))
        gen_id = generation_id or f"gen-{uuid.uuid4().hex[:12]}"
        protos = [entry_proto(e, gen_id) for e in sorted(entries, key=lambda e: e["action_type"])]
        digest = versioned_digest("catalog", [scope[3], sorted(e.entry_digest for e in protos)])
        generation = catalog_v1.CatalogGeneration(
            scope=common_v1.TrustedRuntimeWorkScope(
                org_id=org_id,
                app_installation_id=app,
                runtime_capability_id=capability,
                runtime_work_binding_digest=scope[3],
            ),
            runtime_work_binding=binding,
            catalog_generation_id=gen_id,
            catalog_digest=digest if sealed else "",
            contract_version=1,
            state=catalog_v1.GenerationState.GENERATION_STATE_SEALED
            if sealed
            else catalog_v1.GenerationState.GENERATION_STATE_OPEN,
            entry_count=len(protos),
        )
        with self.lock:
            self.views[(org_id, app, v.runtime_metadata_view_digest)] = v
            self.bindings[scope] = binding
            self.generations[(scope, gen_id)] = (generation, protos)
        return Published(scope, binding, v.runtime_metadata_view_digest, gen_id, digest)

    def references_of(self, scope: ScopeKey) -> set[tuple[str, str]]:
        with self.lock:
            return {(t, h) for s, t, h in self.references if s == scope}

    # --- RPCs ------------------------------------------------------------------------------

    def _generation(self, scope: Any, generation_id: str) -> tuple[Any, list[Any]]:
        with self.lock:
            found = self.generations.get((_key(scope), generation_id))
        if found is None:
            raise NotFoundError("CatalogGeneration", generation_id)
        return found

    async def GetWorkBinding(self, request: Any, context: Any) -> Any:
        with self.lock:
            binding = self.bindings.get(_key(request.scope))
        if binding is None:
            raise NotFoundError("RuntimeWorkBinding")
        return catalog_v1.GetWorkBindingResponse(
            work_binding=common_v1.RegisteredWorkBinding(
                binding=binding,
                runtime_work_binding_digest=request.scope.runtime_work_binding_digest,
            )
        )

    async def GetGeneration(self, request: Any, context: Any) -> Any:
        generation, _ = self._generation(request.scope, request.catalog_generation_id)
        return catalog_v1.GetGenerationResponse(generation=generation)

    async def ListEntries(self, request: Any, context: Any) -> Any:
        generation, entries = self._generation(request.scope, request.catalog_generation_id)
        if generation.catalog_digest != request.catalog_digest:
            raise NotFoundError("CatalogGeneration", request.catalog_generation_id)
        if generation.state != catalog_v1.GenerationState.GENERATION_STATE_SEALED:
            raise FailedPreconditionError("generation is not sealed")
        start = int(request.page_token or 0)
        page = entries[start : start + PAGE_SIZE]
        more = start + PAGE_SIZE < len(entries)
        return catalog_v1.ListEntriesResponse(
            entries=page, next_page_token=str(start + PAGE_SIZE) if more else ""
        )

    async def GetMetadataView(self, request: Any, context: Any) -> Any:
        org = current_identity().org_id
        with self.lock:
            view = self.views.get(
                (org, request.app_installation_id, request.runtime_metadata_view_digest)
            )
        if view is None:
            raise NotFoundError("MetadataView", request.runtime_metadata_view_digest)
        return catalog_v1.GetMetadataViewResponse(view=view)

    def _target(self, scope: Any, ref: Any) -> str:
        if ref.HasField("catalog_generation"):
            g = ref.catalog_generation
            generation, _ = self._generation(scope, g.catalog_generation_id)
            if generation.catalog_digest != g.catalog_digest:
                raise NotFoundError("CatalogGeneration", g.catalog_generation_id)
            return f"generation:{g.catalog_generation_id}"
        digest = ref.metadata_view.runtime_metadata_view_digest
        key = (scope.org_id, scope.app_installation_id, digest)
        with self.lock:
            if key not in self.views:
                raise NotFoundError("MetadataView", digest)
        return f"view:{digest}"

    async def RegisterReference(self, request: Any, context: Any) -> Any:
        target = self._target(request.scope, request.reference)
        with self.lock:
            self.references.add((_key(request.scope), target, request.reference.holder_id))
        return catalog_v1.RegisterReferenceResponse(reference=request.reference)

    async def ReleaseReference(self, request: Any, context: Any) -> Any:
        target = self._target(request.scope, request.reference)
        item = (_key(request.scope), target, request.reference.holder_id)
        with self.lock:
            released = item in self.references
            self.references.discard(item)
            if released:
                self.released.append(item)
        return catalog_v1.ReleaseReferenceResponse(released=released)
