"""``nexus.flow.runtime.v1.FlowDefinitionService``: the gRPC face of
:mod:`runtime_svc.definitions`.

Servicer methods are thin (decode → service → encode). The org and work scope always come
from the verified credential (:func:`services.auth.current_identity`); the auth
interceptor has already rejected any body ``org_id``/``scope`` that disagrees with it, so
a body value is checked, never used.

Wire it into the runtime process with :func:`build_definition_service`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.api.definitions_proto import (
    activation_proto,
    diagnostic_proto,
    flow_version_proto,
    inventory_entry_proto,
    plan_proto,
    plan_summary_proto,
    profile_from_proto,
)
from runtime_svc.catalog_client import (
    CatalogPort,
    GrpcCatalogClient,
    ScopedCredentials,
    catalog_channel,
)
from runtime_svc.definitions import DefinitionService
from runtime_svc.definitions.activation import ActivationOutcome
from runtime_svc.definitions.service import CompileOutcome
from runtime_svc.waits.registry import ProducerRegistry
from services.auth import TrustedRuntimeWorkScope, current_identity
from services.config import ServiceConfig
from services.grpc_server import ServiceRegistration
from services.paging import DEFAULT_CLIENT_MAX_BYTES, fit_page, response_budget
from services.proto import runtime_v1
from services.request_dedupe import DedupeScope, RequestKey

__all__ = ["SERVICE_NAME", "FlowDefinitionServicer", "build_definition_service"]

SERVICE_NAME = "nexus.flow.runtime.v1.FlowDefinitionService"

Context = Any  # grpc.aio.ServicerContext


def _request_key(rpc: str, request: Any) -> RequestKey:
    """The dedupe key: the caller's complete trusted scope, the RPC and ``request_id``."""
    return RequestKey.of(DedupeScope.of_identity(current_identity()), rpc, request)


def _work_scope() -> TrustedRuntimeWorkScope:
    return current_identity().require_work_scope()


def _bytes(message: Any) -> bytes:
    data: bytes = message.SerializeToString(deterministic=True)
    return data


class FlowDefinitionServicer(runtime_v1.FlowDefinitionServiceServicer):
    """Flow versions, compiled plans, activation bindings and inventory (§7, §20.4).

    Mutating RPCs are deduplicated on ``request_id`` (:meth:`DefinitionService.once`): a
    retry gets the original response bytes, a reuse with another body is refused.
    """

    def __init__(
        self, service: DefinitionService, *, max_response_bytes: int = DEFAULT_CLIENT_MAX_BYTES
    ) -> None:
        self._svc = service
        self._max_response = max_response_bytes

    async def RegisterFlowVersion(self, request: Any, context: Context) -> Any:
        key = _request_key("RegisterFlowVersion", request)
        org = current_identity().org_id

        async def register() -> Any:
            return await self._svc.register_flow_version(
                org, request.flow_api_name, request.source_json, request.label
            )

        def encode(row: Any) -> bytes:
            return _bytes(
                runtime_v1.RegisterFlowVersionResponse(
                    flow_version=flow_version_proto(row, self._svc.source_info(row))
                )
            )

        data = await self._svc.once(key, register, encode)
        return runtime_v1.RegisterFlowVersionResponse.FromString(data)

    async def CompileFlowVersion(self, request: Any, context: Context) -> Any:
        key = _request_key("CompileFlowVersion", request)
        scope = _work_scope()
        profile = profile_from_proto(request.requested_profile)

        async def compile_() -> CompileOutcome:
            return await self._svc.compile_flow_version(
                scope,
                request.flow_version_id,
                request.catalog_generation_id,
                request.catalog_digest,
                profile,
            )

        def encode(outcome: CompileOutcome) -> bytes:
            return _bytes(
                runtime_v1.CompileFlowVersionResponse(
                    compiled=outcome.compiled,
                    plan=None if outcome.plan is None else plan_summary_proto(outcome.plan),
                    diagnostics=[diagnostic_proto(d) for d in outcome.diagnostics],
                )
            )

        data = await self._svc.once(key, compile_, encode)
        return runtime_v1.CompileFlowVersionResponse.FromString(data)

    async def ActivateFlowVersion(self, request: Any, context: Context) -> Any:
        key = _request_key("ActivateFlowVersion", request)
        scope = _work_scope()

        async def activate() -> ActivationOutcome:
            return await self._svc.activate_flow_version(
                scope,
                key.request_id,
                request.flow_version_id,
                request.plan_id,
                request.plan_digest,
            )

        def encode(outcome: ActivationOutcome) -> bytes:
            return _bytes(
                runtime_v1.ActivateFlowVersionResponse(
                    activation=activation_proto(outcome.activation),
                    diagnostics=[diagnostic_proto(d) for d in outcome.diagnostics],
                )
            )

        data = await self._svc.once(key, activate, encode)
        return runtime_v1.ActivateFlowVersionResponse.FromString(data)

    async def DeactivateFlowVersion(self, request: Any, context: Context) -> Any:
        key = _request_key("DeactivateFlowVersion", request)
        identity = current_identity()

        async def deactivate() -> Any:
            return await self._svc.deactivate_flow_version(
                identity.org_id,
                request.flow_version_id,
                app_installation_id=identity.org.app_installation_id,
                runtime_capability_id=identity.runtime_capability_id,
            )

        def encode(row: Any) -> bytes:
            return _bytes(
                runtime_v1.DeactivateFlowVersionResponse(activation=activation_proto(row))
            )

        data = await self._svc.once(key, deactivate, encode)
        return runtime_v1.DeactivateFlowVersionResponse.FromString(data)

    async def GetPlan(self, request: Any, context: Context) -> Any:
        identity = current_identity()
        # A plan of another installation/capability/binding than the credential's answers
        # exactly like a missing one.
        view = await self._svc.get_plan(
            identity.org_id, request.plan_id, visible_to=identity.scope_components()
        )
        return runtime_v1.GetPlanResponse(
            plan=plan_proto(view.row, view.plan, view.subflow_version_ids)
        )

    async def ListFlowVersions(self, request: Any, context: Context) -> Any:
        identity = current_identity()

        async def fetch(size: int) -> Any:
            rows, activations, token = await self._svc.list_flow_versions(
                identity.org_id,
                request.flow_api_name,
                size,
                request.page_token,
                app_installation_id=identity.org.app_installation_id,
                runtime_capability_id=identity.runtime_capability_id,
            )
            return runtime_v1.ListFlowVersionsResponse(
                flow_versions=[flow_version_proto(r, self._svc.source_info(r)) for r in rows],
                activations=[activation_proto(a) for a in activations],
                next_page_token=token,
            )

        return await fit_page(
            fetch,
            lambda r: r.flow_versions,
            page_size=request.page_size,
            budget=self._max_response,
            what="flow version",
        )

    async def GetInventory(self, request: Any, context: Context) -> Any:
        scope = _work_scope()

        async def fetch(size: int) -> Any:
            rows, token = await self._svc.inventory(
                scope,
                request.catalog_generation_id,
                request.catalog_digest,
                list(request.flow_api_names),
                size,
                request.page_token,
            )
            return runtime_v1.GetInventoryResponse(
                entries=[inventory_entry_proto(r) for r in rows], next_page_token=token
            )

        return await fit_page(
            fetch,
            lambda r: r.entries,
            page_size=request.page_size,
            budget=self._max_response,
            what="inventory entry",
        )


async def build_definition_service(
    cfg: ServiceConfig,
    engine: AsyncEngine,
    *,
    catalog: CatalogPort | None = None,
    catalog_target: str | None = None,
    credentials: Callable[[TrustedRuntimeWorkScope], str] | None = None,
    producers: ProducerRegistry | None = None,
) -> ServiceRegistration:
    """The FlowDefinitionService registration for ``runtime_svc.app.build_services``.

    Args:
        cfg: the runtime's configuration.
        engine: the runtime database.
        catalog: a catalog port to use instead of a gRPC client (tests).
        catalog_target: ``host:port`` of the catalog (default: the catalog's configured
            listen address and port, ``FLOW_CATALOG_PORT``).
        credentials: mints the catalog credential of a work scope (default: signed with
            ``FLOW_AUTH_SIGNING_KEY``).
        producers: the runtime's wait-producer registry (compile and activation checks).
    """
    if catalog is None:
        channel = catalog_channel(cfg, catalog_target)
        catalog = GrpcCatalogClient(channel, credentials or ScopedCredentials.for_service(cfg))
    service = DefinitionService(engine, catalog, producers=producers)
    return ServiceRegistration(
        SERVICE_NAME,
        runtime_v1.add_FlowDefinitionServiceServicer_to_server,
        FlowDefinitionServicer(service, max_response_bytes=response_budget(cfg)),
    )
