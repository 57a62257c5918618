"""Servicer wiring of the catalog service."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy.ext.asyncio import AsyncEngine

from services.config import ServiceConfig
from services.grpc_server import ServiceRegistration, unimplemented_servicer
from services.proto import catalog_v1

__all__ = ["SERVICE_NAMES", "build_services"]

SERVICE_NAMES = ("nexus.flow.catalog.v1.CatalogService",)


async def build_services(cfg: ServiceConfig, engine: AsyncEngine) -> Sequence[ServiceRegistration]:
    """The catalog RPCs."""
    del cfg, engine
    return [
        ServiceRegistration(
            SERVICE_NAMES[0],
            catalog_v1.add_CatalogServiceServicer_to_server,
            unimplemented_servicer(catalog_v1.CatalogServiceServicer),
        )
    ]
