"""Servicer wiring of the runtime service."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.api.definitions import build_definition_service
from runtime_svc.api.records import CatalogRecordViews, build_record_service
from runtime_svc.api.runs import build_run_service
from runtime_svc.catalog_client import ScopedCredentials, catalog_channel
from runtime_svc.migration.process import start_bridge_duties
from runtime_svc.worker.background import start_background
from runtime_svc.worker.settings import WorkerSettings
from runtime_svc.worker.views import FixedViews, RecordViewSource
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
    view source (one channel, one cache of immutable views)."""
    views = CatalogRecordViews(catalog_channel(cfg), ScopedCredentials.from_config(cfg))
    run_views = None if WorkerSettings.from_env().view_file else views
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
    """The runtime's workers and sweeps (``FLOW_RUNTIME_WORKERS``/``FLOW_RUNTIME_SWEEPS``)
    and its bridge duties (§20.3: writer registration — a binary the control record has
    left behind refuses to start here, before serving — heartbeat, legacy scheduler).

    Mutation steps validate against the metadata view of the run's work scope, read from
    the catalog (``FLOW_CATALOG_TARGET``) exactly as the record service reads it; only a
    test/dev ``FLOW_RUNTIME_VIEW_FILE`` replaces it.
    """
    settings = WorkerSettings.from_env()
    views = None
    if not settings.view_file:
        views = CatalogRecordViews(catalog_channel(cfg), ScopedCredentials.from_config(cfg))
    background = await start_background(cfg, engine, views=views, settings=settings)
    legacy_views: RecordViewSource | None = views
    if legacy_views is None and settings.view_file:
        legacy_views = FixedViews.from_file(settings.view_file)
    try:
        return await start_bridge_duties(
            engine,
            background,
            views=legacy_views,
            legacy_scheduler=settings.legacy_scheduler,
            lease_ms=settings.lease_ms,
            idle_s=settings.idle_ms / 1000,
        )
    except BaseException:
        await background.stop()
        raise
