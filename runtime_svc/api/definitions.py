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
from runtime_svc.waits.registry import ProducerRegistry
from services.auth import TrustedRuntimeWorkScope, current_identity
from services.config import ServiceConfig
from services.errors import InvalidArgumentError
from services.grpc_server import ServiceRegistration
from services.paging import DEFAULT_CLIENT_MAX_BYTES, fit_page, response_budget
from services.proto import runtime_v1

__all__ = ["SERVICE_NAME", "FlowDefinitionServicer", "build_definition_service"]

SERVICE_NAME = "nexus.flow.runtime.v1.FlowDefinitionService"

Context = Any  # grpc.aio.ServicerContext


def _require_request_id(request: Any) -> str:
    request_id: str = request.request_id
    if not request_id:
        raise InvalidArgumentError("request_id is required", field_path="request_id")
    return request_id


def _work_scope() -> TrustedRuntimeWorkScope:
    return current_identity().require_work_scope()


class FlowDefinitionServicer(runtime_v1.FlowDefinitionServiceServicer):
    """Flow versions, compiled plans, activation bindings and inventory (§7, §20.4)."""

    def __init__(
        self, service: DefinitionService, *, max_response_bytes: int = DEFAULT_CLIENT_MAX_BYTES
    ) -> None:
        self._svc = service
        self._max_response = max_response_bytes

    async def RegisterFlowVersion(self, request: Any, context: Context) -> Any:
        _require_request_id(request)
        org = current_identity().org_id
        row = await self._svc.register_flow_version(
            org, request.flow_api_name, request.source_json, request.label
        )
        return runtime_v1.RegisterFlowVersionResponse(
            flow_version=flow_version_proto(row, self._svc.source_info(row))
        )

    async def CompileFlowVersion(self, request: Any, context: Context) -> Any:
        _require_request_id(request)
        outcome = await self._svc.compile_flow_version(
            _work_scope(),
            request.flow_version_id,
            request.catalog_generation_id,
            request.catalog_digest,
            profile_from_proto(request.requested_profile),
        )
        return runtime_v1.CompileFlowVersionResponse(
            compiled=outcome.compiled,
            plan=None if outcome.plan is None else plan_summary_proto(outcome.plan),
            diagnostics=[diagnostic_proto(d) for d in outcome.diagnostics],
        )

    async def ActivateFlowVersion(self, request: Any, context: Context) -> Any:
        request_id = _require_request_id(request)
        outcome = await self._svc.activate_flow_version(
            _work_scope(),
            request_id,
            request.flow_version_id,
            request.plan_id,
            request.plan_digest,
        )
        return runtime_v1.ActivateFlowVersionResponse(
            activation=activation_proto(outcome.activation),
            diagnostics=[diagnostic_proto(d) for d in outcome.diagnostics],
        )

    async def DeactivateFlowVersion(self, request: Any, context: Context) -> Any:
        _require_request_id(request)
        identity = current_identity()
        row = await self._svc.deactivate_flow_version(
            identity.org_id,
            request.flow_version_id,
            app_installation_id=identity.org.app_installation_id,
            runtime_capability_id=identity.runtime_capability_id,
        )
        return runtime_v1.DeactivateFlowVersionResponse(activation=activation_proto(row))

    async def GetPlan(self, request: Any, context: Context) -> Any:
        view = await self._svc.get_plan(current_identity().org_id, request.plan_id)
        return runtime_v1.GetPlanResponse(
            plan=plan_proto(view.row, view.plan, view.subflow_version_ids)
        )

    async def ListFlowVersions(self, request: Any, context: Context) -> Any:
        org = current_identity().org_id

        async def fetch(size: int) -> Any:
            rows, activations, token = await self._svc.list_flow_versions(
                org, request.flow_api_name, size, request.page_token
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
