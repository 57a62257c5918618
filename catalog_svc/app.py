"""Servicer and background-loop wiring of the catalog service."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

from sqlalchemy.ext.asyncio import AsyncEngine

from catalog_svc import schema
from catalog_svc.api.servicer import CatalogServicer
from catalog_svc.service import CatalogService
from catalog_svc.store import CatalogRepository
from services.background import LoopGroup
from services.config import ServiceConfig
from services.grpc_server import ServiceRegistration
from services.paging import response_budget
from services.proto import catalog_v1
from services.request_dedupe import RequestLedger
from services.request_retention import RequestRetention

__all__ = ["SERVICE_NAMES", "build_services", "start_catalog_background"]

#: Pause between two passes of the request-retention sweep.
_REQUEST_SWEEP_INTERVAL_S = 300.0

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


async def start_catalog_background(cfg: ServiceConfig, engine: AsyncEngine) -> LoopGroup:
    """The catalog's background loops (``services.background`` lifecycle): the retention
    sweep of the request-dedupe ledger (``FLOW_REQUEST_RETENTION_HOURS``)."""
    group = LoopGroup()
    group.add(
        RequestRetention(
            engine,
            RequestLedger(schema.catalog_requests),
            retention=timedelta(hours=cfg.request_retention_hours),
            interval_s=_REQUEST_SWEEP_INTERVAL_S,
        )
    )
    return group.start()
