"""Servicer wiring of the runtime service."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.api.definitions import build_definition_service
from runtime_svc.api.records import build_record_service
from runtime_svc.api.runs import build_run_service
from services.config import ServiceConfig
from services.grpc_server import ServiceRegistration, unimplemented_servicer
from services.proto import runtime_v1

__all__ = ["SERVICE_NAMES", "build_services"]

SERVICE_NAMES = (
    "nexus.flow.runtime.v1.FlowDefinitionService",
    "nexus.flow.runtime.v1.FlowRunService",
    "nexus.flow.runtime.v1.RecordService",
    "nexus.flow.runtime.v1.WakeSignalService",
)


async def build_services(cfg: ServiceConfig, engine: AsyncEngine) -> Sequence[ServiceRegistration]:
    """The runtime RPCs; those whose issue has not landed answer UNIMPLEMENTED."""
    return [
        await build_definition_service(cfg, engine),
        await build_run_service(cfg, engine),
        await build_record_service(cfg, engine),
        ServiceRegistration(
            SERVICE_NAMES[3],
            runtime_v1.add_WakeSignalServiceServicer_to_server,
            unimplemented_servicer(runtime_v1.WakeSignalServiceServicer),
        ),
    ]
