"""Servicer wiring of the effect-owner service."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy.ext.asyncio import AsyncEngine

from services.config import ServiceConfig
from services.grpc_server import ServiceRegistration, unimplemented_servicer
from services.proto import effect_v1

__all__ = ["SERVICE_NAMES", "build_services"]

SERVICE_NAMES = ("nexus.flow.effect.v1.EffectOwnerService",)


async def build_services(cfg: ServiceConfig, engine: AsyncEngine) -> Sequence[ServiceRegistration]:
    """The effect-owner RPCs (UNIMPLEMENTED until the effect-protocol work lands)."""
    del cfg, engine
    return [
        ServiceRegistration(
            SERVICE_NAMES[0],
            effect_v1.add_EffectOwnerServiceServicer_to_server,
            unimplemented_servicer(effect_v1.EffectOwnerServiceServicer),
        )
    ]
