"""Servicer wiring of the runtime service."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.api.definitions import build_definition_service
from runtime_svc.api.records import CatalogRecordViews, build_record_service
from runtime_svc.api.runs import build_run_service
from runtime_svc.catalog_client import GrpcCatalogClient, ScopedCredentials, catalog_channel
from runtime_svc.worker.background import start_background
from runtime_svc.worker.binary import BinaryCheck
from runtime_svc.worker.settings import WorkerSettings
from services.auth import load_signing_key
from services.config import ServiceConfig
from services.grpc_server import ServiceRegistration, unimplemented_servicer
from services.proto import runtime_v1
from services.service_main import Background

__all__ = ["SERVICE_NAMES", "build_services", "start_runtime_background"]

SERVICE_NAMES = (
    "nexus.flow.runtime.v1.FlowDefinitionService",
    "nexus.flow.runtime.v1.FlowRunService",
    "nexus.flow.runtime.v1.RecordService",
    "nexus.flow.runtime.v1.WakeSignalService",
)


async def build_services(cfg: ServiceConfig, engine: AsyncEngine) -> Sequence[ServiceRegistration]:
    """The runtime RPCs; those whose issue has not landed answer UNIMPLEMENTED.

    The record service and the synchronous Bounded Atomic executor share one catalog
    view source (one channel, one cache of immutable views).

    Raises:
        ConfigError: in production, the runtime's service key (``FLOW_AUTH_SERVICE_KEY``)
            cannot be read.
    """
    if cfg.is_production:
        # Production keys are provisioned, never generated: a runtime that cannot sign
        # its calls to the catalog must not start (development keys appear on first start).
        load_signing_key(cfg.auth_service_key)
    views = CatalogRecordViews(catalog_channel(cfg), ScopedCredentials.from_config(cfg))
    run_views = None if cfg.runtime_view_file else views
    return [
        await build_definition_service(cfg, engine),
        await build_run_service(cfg, engine, views=run_views),
        await build_record_service(cfg, engine, views),
        ServiceRegistration(
            SERVICE_NAMES[3],
            runtime_v1.add_WakeSignalServiceServicer_to_server,
            unimplemented_servicer(runtime_v1.WakeSignalServiceServicer),
        ),
    ]


async def start_runtime_background(cfg: ServiceConfig, engine: AsyncEngine) -> Background:
    """The runtime's workers and sweeps (``FLOW_RUNTIME_WORKERS``/``FLOW_RUNTIME_SWEEPS``).

    Mutation steps validate against the metadata view of the run's work scope, read from
    the catalog (``FLOW_CATALOG_TARGET``) exactly as the record service reads it, and each
    plan is verified with the catalog before its first claim; only a test/dev
    ``FLOW_RUNTIME_VIEW_FILE`` replaces both.
    """
    settings = WorkerSettings.from_config(cfg)
    views = None
    binary_check = None
    if not settings.view_file:
        channel = catalog_channel(cfg)
        credentials = ScopedCredentials.from_config(cfg)
        views = CatalogRecordViews(channel, credentials)
        # §8.4: before the first claim of a plan, verify with the catalog that this binary
        # executes exactly the sealed entries the plan pins.
        binary_check = BinaryCheck(GrpcCatalogClient(channel, credentials))
    return await start_background(
        cfg, engine, views=views, settings=settings, binary_check=binary_check
    )
