"""The runtime's client of the Catalog service: the only way the runtime reads catalog
artifacts or registers retention references (ARCHITECTURE §1: no service reads another
service's tables).

* :class:`CatalogPort` — what the definitions service needs from the catalog; tests may
  substitute a fake.
* :class:`GrpcCatalogClient` — the implementation over ``catalog_v1.CatalogServiceStub``.
  Every call carries a workload credential minted for the *complete trusted scope* of
  the request it serves (the catalog answers a lookup in another scope exactly like a
  missing row), and a deadline.
* ``*_doc`` functions — the anti-corruption layer from catalog protos to the compiler's
  JSON input contract (see :mod:`runtime_svc.definitions.inputs`).

Catalog statuses become :class:`~services.errors.FlowError` subclasses here, so the
runtime's one error interceptor maps them again; catalog internals never leak.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc
import grpc.aio

from runtime_svc.definitions.inputs import CatalogSnapshot
from services.auth import (
    TrustedRuntimeWorkScope,
    bearer_metadata,
)
from services.channels import client_channel
from services.config import ServiceConfig, ServiceName
from services.digest import versioned_digest
from services.errors import FailedPreconditionError, FlowError, NotFoundError
from services.peer_client import ScopedCredentials as PeerCredentials
from services.proto import catalog_v1, common_v1
from services.remote_errors import remote_error

__all__ = [
    "DEFAULT_CALL_TIMEOUT_S",
    "CatalogPort",
    "GrpcCatalogClient",
    "ScopedCredentials",
    "binding_doc",
    "catalog_channel",
    "descriptor_doc",
    "entry_doc",
    "generation_doc",
    "metadata_view_doc",
    "scope_proto",
]

_log = logging.getLogger(__name__)

#: Deadline of one catalog call.
DEFAULT_CALL_TIMEOUT_S = 10.0
#: Bound on ListEntries pages read for one generation (page size is the server's).
_MAX_ENTRY_PAGES = 1000
#: Scopes whose credential source is kept.
_MAX_CACHED_SCOPES = 256


class CatalogPort(Protocol):
    """What the definitions service needs from the catalog."""

    async def load_snapshot(
        self, scope: TrustedRuntimeWorkScope, generation_id: str, catalog_digest: str
    ) -> CatalogSnapshot:
        """The sealed generation, its entries, its binding and its metadata view.

        Raises:
            NotFoundError: no such generation (or digest) in ``scope``.
            FailedPreconditionError: the generation is not sealed, or its view is gone.
        """
        ...

    async def load_metadata_view(
        self, scope: TrustedRuntimeWorkScope, view_digest: str
    ) -> Mapping[str, Any] | None:
        """The view as a compiler document, or ``None`` when the catalog has none."""
        ...

    async def register_plan_references(
        self,
        scope: TrustedRuntimeWorkScope,
        plan_id: str,
        generation_id: str,
        catalog_digest: str,
        view_digest: str,
    ) -> None:
        """Retention references of an activated plan on its generation and its view."""
        ...

    async def release_plan_references(
        self,
        scope: TrustedRuntimeWorkScope,
        plan_id: str,
        generation_id: str,
        catalog_digest: str,
        view_digest: str,
    ) -> None:
        """Release what :meth:`register_plan_references` registered (idempotent)."""
        ...


# --- proto -> compiler JSON ------------------------------------------------------------

_EXECUTION_CLASS = {
    1: "pure_compute",
    2: "record_read",
    3: "record_mutation",
    4: "wait",
    5: "external_effect",
}
_TRANSACTION = {
    1: "caller_transaction",
    2: "owned_transaction",
    3: "transaction_forbidden",
    4: "profile_dependent",
}
_REPLAY = {
    1: "deterministic_replay",
    2: "idempotent_by_key",
    3: "at_most_once",
    4: "not_replayable",
}
_FANOUT = {1: "static", 2: "metadata_derived", 3: "unknown"}
_READ = {1: "checkpoint_only", 2: "current_transactional", 3: "verified_snapshot"}
_LOCK = {1: "static_keys", 2: "metadata_derived", 3: "late_discovery_allowed", 4: "unknown"}
_DURABILITY = {1: "ephemeral", 2: "checkpointed", 3: "owner_receipt"}
_OWNER = {1: "none", 2: "integration_work", 3: "runtime_delivery", 4: "registered_owner"}
_IDEMPOTENCY_SCOPE = {1: "step_invocation", 2: "flow_run", 3: "runtime_work_scope", 4: "org"}
_PRINCIPAL = {1: "caller", 2: "initiating_principal", 3: "system"}
_REAUTH = {1: "fault_path", 2: "terminal_failure", 3: "system_handoff"}
_TIMING = {1: "before_save", 2: "after_save"}
_EVENT = {1: "create", 2: "update", 3: "delete"}
# Catalog field types -> the compiler's value types.
_FIELD_TYPE = {
    1: "string",
    2: "string",
    3: "number",
    4: "number",
    5: "boolean",
    6: "date",
    7: "datetime",
    8: "string",
    9: "string",
    10: "reference",
    11: "string",
    12: "number",
}
_GENERATION_SEALED = catalog_v1.GenerationState.GENERATION_STATE_SEALED
_MASTER_DETAIL = catalog_v1.RelationshipKind.RELATIONSHIP_KIND_MASTER_DETAIL


def scope_proto(scope: TrustedRuntimeWorkScope) -> Any:
    """``common_v1.TrustedRuntimeWorkScope`` of a trusted scope."""
    return common_v1.TrustedRuntimeWorkScope(
        org_id=scope.org_id,
        app_installation_id=scope.app_installation_id,
        runtime_capability_id=scope.runtime_capability_id,
        runtime_work_binding_digest=scope.runtime_work_binding_digest,
    )


def binding_doc(binding: Any, binding_digest: str) -> dict[str, Any]:
    """``RuntimeWorkBindingRef`` document of a ``common_v1.RuntimeWorkBinding``."""
    return {
        "org_id": binding.org_id,
        "app_installation_id": binding.app_installation_id,
        "runtime_capability_id": binding.runtime_capability_id,
        "catalog_revision": binding.catalog_revision,
        "schema_generation": binding.schema_generation,
        "engine_generation": binding.engine_generation,
        "catalog_snapshot_digest": binding.catalog_snapshot_digest,
        "metadata_view_digest": binding.runtime_metadata_view_digest,
        "binding_digest": binding_digest,
    }


def generation_doc(generation: Any) -> dict[str, Any]:
    """``CatalogGenerationRef`` document of a ``catalog_v1.CatalogGeneration``."""
    s = generation.scope
    return {
        "org_id": s.org_id,
        "app_installation_id": s.app_installation_id,
        "runtime_capability_id": s.runtime_capability_id,
        "binding_digest": s.runtime_work_binding_digest,
        "generation_id": generation.catalog_generation_id,
        "catalog_digest": generation.catalog_digest,
        "sealed": generation.state == _GENERATION_SEALED,
    }


def descriptor_doc(d: Any) -> dict[str, Any]:
    """The compiler's capability document of a ``common_v1.CapabilityDescriptor``.

    An unset enum or an absent sub-message maps to "unknown" (absent key), so a
    capability the descriptor does not declare stays visible and fails closed (§8.4).
    """
    out: dict[str, Any] = {}

    def put(key: str, table: Mapping[int, str], value: int) -> None:
        if value in table:
            out[key] = table[value]

    put("execution_class", _EXECUTION_CLASS, d.execution_class)
    put("transaction_policy", _TRANSACTION, d.transaction_policy)
    put("replay_policy", _REPLAY, d.replay_policy)
    put("read_contract", _READ, d.read_contract)
    put("output_durability", _DURABILITY, d.output_durability)
    if d.HasField("fanout_bound") and d.fanout_bound.kind in _FANOUT:
        fb = d.fanout_bound
        out["fanout_bound"] = {
            "kind": _FANOUT[fb.kind],
            "max": fb.static_maximum if fb.kind == 1 else None,
            "relationship": fb.metadata_path or None,
        }
    if d.HasField("lock_plan_contract") and d.lock_plan_contract.kind in _LOCK:
        lp = d.lock_plan_contract
        classes = set(lp.resource_classes) | {k.resource_class for k in lp.static_keys}
        out["lock_plan"] = {
            "kind": _LOCK[lp.kind],
            "resource_classes": sorted(classes),
            "objects": sorted({k.namespace for k in lp.static_keys if k.namespace}),
        }
    if d.HasField("effect_owner") and d.effect_owner.owner_class in _OWNER:
        eo = d.effect_owner
        out["effect_owner"] = {
            "kind": _OWNER[eo.owner_class],
            "owner_id": eo.effect_owner_kind or None,
        }
    if d.HasField("idempotency_policy"):
        ip = d.idempotency_policy
        if ip.key_required:
            # A required key must say its shape and scope; what is missing stays unknown.
            out["idempotency"] = {
                "key_shape": ip.key_shape or None,
                "scope": _IDEMPOTENCY_SCOPE.get(ip.uniqueness_scope),
            }
        else:
            out["idempotency"] = {"key_shape": ip.key_shape or "none", "scope": "none"}
    if d.HasField("security_policy"):
        sp = d.security_policy
        out["security"] = {
            "principal_mode": _PRINCIPAL.get(sp.principal_mode),
            "reauthorization": _REAUTH.get(sp.reauthorization_policy),
        }
    if d.minimum_capability_version > 0:
        out["minimum_capability_version"] = d.minimum_capability_version
    return out


def entry_doc(entry: Any) -> dict[str, Any]:
    """``CapabilityEntryView`` document of a ``catalog_v1.CatalogEntry``."""
    hb = entry.handler_binding
    return {
        "action_type": entry.action_type,
        "entry_digest": entry.entry_digest,
        "binding_fingerprint": entry.binding_fingerprint,
        "owner_id": hb.owner_registration_id,
        "handler_ref": hb.handler_ref,
        "handler_version": hb.handler_implementation_version or hb.service_release_digest,
        "contract_only": entry.contract_only,
        "capabilities": descriptor_doc(entry.descriptor) if entry.HasField("descriptor") else {},
    }


def _params(params: Any) -> list[dict[str, Any]]:
    return [
        {"name": p.name, "type": _FIELD_TYPE.get(p.type, "string"), "required": p.required}
        for p in params
    ]


def metadata_view_doc(view: Any) -> dict[str, Any]:
    """``MetadataViewInput`` document of a ``catalog_v1.MetadataView``.

    A relationship's ``max_children`` 0 (undeclared) maps to ``None``: fan-out over it is
    unknown and fails closed; objects carry ``history_tracked``. Subscription
    ``flow_version`` is left ``None`` (pinned per compile). Every object gets the implicit
    record identity field ``Id`` when it does not list it.
    """
    objects = []
    for o in view.objects:
        fields = [
            {
                "name": f.api_name,
                "type": _FIELD_TYPE.get(f.type, "string"),
                "reference_to": f.reference_object_api_name or None,
            }
            for f in o.fields
        ]
        if not any(f["name"] == "Id" for f in fields):
            fields.insert(0, {"name": "Id", "type": "id", "reference_to": None})
        objects.append(
            {"api_name": o.api_name, "fields": fields, "history_tracked": o.history_tracked}
        )
    relationships = [
        {
            "name": r.name,
            "parent_object": r.parent_object_api_name,
            "child_object": r.child_object_api_name,
            "field": r.child_field_api_name,
            "max_children": r.max_children if r.max_children > 0 else None,
            "lock_parent": bool(r.lock_relevant or r.kind == _MASTER_DETAIL),
        }
        for r in view.relationships
    ]
    subscriptions = [
        {
            "flow_api_name": s.flow_api_name,
            "flow_version": None,
            "object": s.object_api_name,
            "timing": _TIMING.get(s.timing, "unspecified"),
            "events": sorted(_EVENT[e] for e in s.events if e in _EVENT),
            "dispatch_order": int(s.dispatch_order),
        }
        for s in view.trigger_subscriptions
    ]
    actions = [
        {"action_type": a.action_type, "inputs": _params(a.inputs), "outputs": _params(a.outputs)}
        for a in view.actions
    ]
    return {
        "digest": view.runtime_metadata_view_digest,
        "objects": objects,
        "relationships": relationships,
        "trigger_subscriptions": subscriptions,
        "actions": actions,
        "wait_producers": [],
    }


# --- credentials -----------------------------------------------------------------------


class ScopedCredentials(PeerCredentials):
    """Mints (and reuses until near expiry) one catalog credential per trusted work scope.

    The runtime calls the catalog *for* a request's complete trusted scope, so each
    scope gets its own credential (audience ``catalog``, subject ``runtime``, no roles),
    signed with the runtime's own service key (``FLOW_AUTH_SERVICE_KEY``): the one
    per-scope minting of :class:`services.peer_client.ScopedCredentials` with the
    catalog as audience. The signing key may be given as a path; it is then read on
    first use (a development server creates its keys only when it starts serving).
    """

    def __init__(self, private_key: Any | Path, key_id: str, *, subject: str = "runtime") -> None:
        super().__init__(private_key, key_id, audience=ServiceName.CATALOG, subject=subject)

    @classmethod
    def for_service(cls, cfg: ServiceConfig) -> ScopedCredentials:
        """Sign with ``cfg.auth_service_key`` under ``cfg.auth_service_key_id``."""
        return cls(cfg.auth_service_key, cfg.auth_service_key_id)


def catalog_channel(cfg: ServiceConfig, target: str | None = None) -> grpc.aio.Channel:
    """The runtime's channel to the catalog: ``target`` or ``FLOW_CATALOG_TARGET``, through
    the one inter-service channel factory (client TLS/mTLS, message limits). Credentials
    are per call (one per trusted work scope, :class:`ScopedCredentials`)."""
    return client_channel(target or cfg.catalog_target, cfg, audience=ServiceName.CATALOG)


# --- the client ------------------------------------------------------------------------


def _catalog_error(exc: grpc.aio.AioRpcError, what: str, key: str) -> FlowError:
    return remote_error(exc, service="catalog", what=what, key=key)


@dataclass(frozen=True)
class _Ref:
    target: str
    holder_id: str


class GrpcCatalogClient:
    """:class:`CatalogPort` over a gRPC channel to the catalog service."""

    def __init__(
        self,
        channel: grpc.aio.Channel,
        credentials: Callable[[TrustedRuntimeWorkScope], str],
        *,
        timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
    ) -> None:
        self._stub = catalog_v1.CatalogServiceStub(channel)
        self._credentials = credentials
        self._timeout = timeout_s

    def _md(self, scope: TrustedRuntimeWorkScope) -> tuple[tuple[str, str], ...]:
        return bearer_metadata(self._credentials(scope))

    async def load_snapshot(
        self, scope: TrustedRuntimeWorkScope, generation_id: str, catalog_digest: str
    ) -> CatalogSnapshot:
        md, sp = self._md(scope), scope_proto(scope)
        try:
            gen = (
                await self._stub.GetGeneration(
                    catalog_v1.GetGenerationRequest(scope=sp, catalog_generation_id=generation_id),
                    metadata=md,
                    timeout=self._timeout,
                )
            ).generation
        except grpc.aio.AioRpcError as exc:
            raise _catalog_error(exc, "CatalogGeneration", generation_id) from exc
        if gen.state != _GENERATION_SEALED:
            raise FailedPreconditionError(
                f"catalog generation {generation_id} is not sealed; only a sealed generation "
                "can be compiled against (§8.2)",
                reason="catalog_generation_not_sealed",
            )
        if gen.catalog_digest != catalog_digest:
            # The catalog answers a digest mismatch like a missing row; so do we.
            raise NotFoundError("CatalogGeneration", f"{generation_id}@{catalog_digest}")
        entries = await self._entries(scope, generation_id, catalog_digest)
        binding = binding_doc(gen.runtime_work_binding, scope.runtime_work_binding_digest)
        view = await self.load_metadata_view(scope, binding["metadata_view_digest"])
        if view is None:
            raise FailedPreconditionError(
                "the metadata view "
                f"{binding['metadata_view_digest']} of the work binding is missing",
                reason="metadata_view_missing",
            )
        return CatalogSnapshot(
            binding=binding,
            generation=generation_doc(gen),
            entries=tuple(sorted(entries, key=lambda e: str(e["action_type"]))),
            metadata_view=view,
        )

    async def _entries(
        self, scope: TrustedRuntimeWorkScope, generation_id: str, catalog_digest: str
    ) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        token = ""
        for _ in range(_MAX_ENTRY_PAGES):
            try:
                resp = await self._stub.ListEntries(
                    catalog_v1.ListEntriesRequest(
                        scope=scope_proto(scope),
                        catalog_generation_id=generation_id,
                        catalog_digest=catalog_digest,
                        page_token=token,
                    ),
                    metadata=self._md(scope),
                    timeout=self._timeout,
                )
            except grpc.aio.AioRpcError as exc:
                raise _catalog_error(exc, "CatalogGeneration", generation_id) from exc
            out.extend(entry_doc(e) for e in resp.entries)
            token = resp.next_page_token
            if not token:
                return out
        raise FailedPreconditionError(
            f"catalog generation {generation_id} has more than {_MAX_ENTRY_PAGES} entry pages",
            reason="catalog_generation_too_large",
        )

    async def load_metadata_view(
        self, scope: TrustedRuntimeWorkScope, view_digest: str
    ) -> Mapping[str, Any] | None:
        try:
            resp = await self._stub.GetMetadataView(
                catalog_v1.GetMetadataViewRequest(
                    org_id=scope.org_id,
                    app_installation_id=scope.app_installation_id,
                    runtime_metadata_view_digest=view_digest,
                ),
                metadata=self._md(scope),
                timeout=self._timeout,
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise _catalog_error(exc, "MetadataView", view_digest) from exc
        return metadata_view_doc(resp.view)

    def _references(
        self, plan_id: str, generation_id: str, catalog_digest: str, view_digest: str
    ) -> list[tuple[_Ref, Any]]:
        holder = catalog_v1.ReferenceHolderKind.REFERENCE_HOLDER_KIND_ACTIVATED_PLAN
        return [
            (
                _Ref(f"generation:{generation_id}", plan_id),
                catalog_v1.ArtifactReference(
                    catalog_generation=catalog_v1.GenerationTarget(
                        catalog_generation_id=generation_id, catalog_digest=catalog_digest
                    ),
                    holder_kind=holder,
                    holder_id=plan_id,
                ),
            ),
            (
                _Ref(f"view:{view_digest}", plan_id),
                catalog_v1.ArtifactReference(
                    metadata_view=catalog_v1.MetadataViewTarget(
                        runtime_metadata_view_digest=view_digest
                    ),
                    holder_kind=holder,
                    holder_id=plan_id,
                ),
            ),
        ]

    @staticmethod
    def _request_id(verb: str, scope: TrustedRuntimeWorkScope, ref: _Ref) -> str:
        # Deterministic: a retried registration/release dedupes at the catalog.
        digest = versioned_digest(
            "catalog-reference-request",
            [verb, scope.org_id, scope.runtime_work_binding_digest, ref.target, ref.holder_id],
        )
        return f"rt-{verb}-{digest.rsplit(':', 1)[1][:40]}"

    async def register_plan_references(
        self,
        scope: TrustedRuntimeWorkScope,
        plan_id: str,
        generation_id: str,
        catalog_digest: str,
        view_digest: str,
    ) -> None:
        for ref, proto in self._references(plan_id, generation_id, catalog_digest, view_digest):
            try:
                await self._stub.RegisterReference(
                    catalog_v1.RegisterReferenceRequest(
                        request_id=self._request_id("register", scope, ref),
                        scope=scope_proto(scope),
                        reference=proto,
                    ),
                    metadata=self._md(scope),
                    timeout=self._timeout,
                )
            except grpc.aio.AioRpcError as exc:
                raise _catalog_error(exc, "catalog artifact", ref.target) from exc

    async def release_plan_references(
        self,
        scope: TrustedRuntimeWorkScope,
        plan_id: str,
        generation_id: str,
        catalog_digest: str,
        view_digest: str,
    ) -> None:
        for ref, proto in self._references(plan_id, generation_id, catalog_digest, view_digest):
            try:
                await self._stub.ReleaseReference(
                    catalog_v1.ReleaseReferenceRequest(
                        request_id=self._request_id("release", scope, ref),
                        scope=scope_proto(scope),
                        reference=proto,
                    ),
                    metadata=self._md(scope),
                    timeout=self._timeout,
                )
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    continue  # already released, or the artifact is gone
                raise _catalog_error(exc, "catalog artifact", ref.target) from exc
