"""The bridge duties of one runtime process: register in the writer fleet before serving
(refusing to start when the control record has left this binary behind), heartbeat the
registration, run the LegacyInterpreter scheduler, and mark the registration stopped on
shutdown. Wired by :meth:`runtime_svc.app.RuntimeApp.start_background`.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from datetime import timedelta

from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.compiler import COMPILER_VERSION
from runtime_svc.legacy.service import LegacyInterviewService
from runtime_svc.legacy.store import LegacyInterviewStore
from runtime_svc.migration import fleet
from runtime_svc.migration.protocol import BINARY_VERSION, binary_generation
from runtime_svc.worker.views import RecordViewSource
from services.background import LoopGroup

__all__ = ["BridgeDuties", "start_bridge_duties"]

log = logging.getLogger(__name__)


class BridgeDuties:
    """The registration of this process and the background it extends."""

    def __init__(self, engine: AsyncEngine, background: LoopGroup, process_id: str) -> None:
        self._engine = engine
        self._background = background
        self.process_id = process_id

    async def stop(self) -> None:
        """Stop every loop, then mark this writer stopped (idempotent)."""
        await self._background.stop()
        try:
            await fleet.stop_writer(self._engine, self.process_id)
        except Exception:  # the registration then expires with its lease
            log.exception("could not mark writer %s stopped", self.process_id)


async def start_bridge_duties(
    engine: AsyncEngine,
    background: LoopGroup,
    *,
    views: RecordViewSource | None,
    legacy_scheduler: bool,
    lease_ms: int,
    idle_s: float,
) -> BridgeDuties:
    """Register this process (or raise ``BinaryRefusedError``), then add the heartbeat
    and (``legacy_scheduler``) the legacy scheduler to ``background``."""
    host = f"{socket.gethostname()}:{os.getpid()}"
    process_id = f"rt-{uuid.uuid4().hex[:20]}"
    await fleet.register_writer(
        engine,
        fleet.WriterRegistration(
            process_id, BINARY_VERSION, binary_generation(), COMPILER_VERSION, host
        ),
    )
    lease = fleet.DEFAULT_WRITER_LEASE

    async def heartbeat() -> bool:
        await fleet.heartbeat_writer(engine, process_id, lease=lease)
        return False  # wait the interval

    background.spawn("fleet-heartbeat", heartbeat, lease.total_seconds() / 3, interval=True)
    if legacy_scheduler:
        service = LegacyInterviewService(
            engine,
            LegacyInterviewStore(engine, lease=timedelta(milliseconds=lease_ms)),
            views,
            owner=f"{host}/legacy/{uuid.uuid4().hex[:8]}",
        )
        background.spawn("legacy-scheduler", service.tick, idle_s)
    log.info(
        "bridge: writer %s registered (version %s, write protocol %d), legacy scheduler=%s",
        process_id,
        BINARY_VERSION,
        binary_generation(),
        legacy_scheduler,
    )
    return BridgeDuties(engine, background, process_id)
