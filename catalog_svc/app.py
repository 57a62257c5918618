"""Servicer wiring of the catalog service."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy.ext.asyncio import AsyncEngine

from catalog_svc.api.servicer import CatalogServicer
from catalog_svc.service import CatalogService
from catalog_svc.store import CatalogRepository
from services.config import ServiceConfig
from services.grpc_server import ServiceRegistration
from services.paging import response_budget
from services.proto import catalog_v1

__all__ = ["SERVICE_NAMES", "build_services"]

SERVICE_NAMES = ("nexus.flow.catalog.v1.CatalogService",)


async def build_services(cfg: ServiceConfig, engine: AsyncEngine) -> Sequence[ServiceRegistration]:
    """The catalog RPCs over the catalog database ``engine``."""
    servicer = CatalogServicer(
        CatalogService(CatalogRepository(engine)), max_response_bytes=response_budget(cfg)
    )
    return [
        ServiceRegistration(
            SERVICE_NAMES[0], catalog_v1.add_CatalogServiceServicer_to_server, servicer
        )
    ]
