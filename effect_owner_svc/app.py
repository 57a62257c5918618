"""Servicer and background wiring of the effect-owner service.

The process serves ``EffectOwnerService`` and runs (role flags permitting):

* the command dispatcher (``FLOW_EFFECT_DISPATCHERS`` concurrent provider calls; 0 = off)
  — accepted commands → providers → outcomes and completion receipts;
* the owner-outbox dispatcher and repair sweep (``FLOW_OUTBOX_DISPATCHERS``; 0 = off) —
  completion receipts → the runtime's ``WakeSignalService`` with the owner's own
  workload credential (audience ``runtime``, role ``flow.signals.submit``);
* the retention sweep of the request-dedupe ledger ``owner_requests``
  (``FLOW_REQUEST_RETENTION_HOURS``).

All of them are loops of one :class:`services.background.LoopGroup`.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Sequence
from datetime import timedelta

from sqlalchemy.ext.asyncio import AsyncEngine

from effect_owner_svc.api.servicer import SERVICE_NAME, build_effect_owner_service
from effect_owner_svc.commands.model import CommandPolicy
from effect_owner_svc.dispatcher.commands import CommandDispatcher, CommandSeats
from effect_owner_svc.observability import CommandStateSource
from effect_owner_svc.providers.factory import ProviderSet, build_providers, served_kinds
from effect_owner_svc.receipts.delivery import WakeSignalDelivery
from effect_owner_svc.receipts.outbox import OWNER_OUTBOX
from effect_owner_svc.schema import owner_requests
from services.background import BackgroundLoop, LoopGroup, Wakeup
from services.config import (
    EffectOwnerSettings,
    OutboxSettings,
    ServiceConfig,
    ServiceName,
    load_effect_owner_settings,
    load_outbox_settings,
)
from services.effect_contract import EFFECT_COMPLETION_FAMILY, WAKE_SIGNAL_SUBMIT_ROLE
from services.grpc_server import ServiceRegistration
from services.metrics_state import StateSource
from services.outbox import DeliveryPolicy, FamilyRegistry, MessageFamily, OutboxDispatcher
from services.peer_client import ScopedCredentials, peer_channel
from services.request_dedupe import RequestLedger
from services.request_retention import RequestRetention

__all__ = [
    "SERVICE_NAMES",
    "OwnerApp",
    "OwnerBackground",
    "build_services",
    "start_owner_background",
    "state_sources",
]

log = logging.getLogger(__name__)

SERVICE_NAMES = (SERVICE_NAME,)


class OwnerApp:
    """The owner process: ``build_services`` then ``start_background`` (the
    ``run_service`` factories), sharing this process's wakeups — an accepted command wakes
    the command dispatcher, a written receipt wakes the receipt delivery."""

    def __init__(self) -> None:
        self.commands = Wakeup()
        self.receipts = Wakeup()
        #: The command dispatcher acceptances pre-claim for (ADR 0008; set while it runs).
        self.seats = CommandSeats()

    async def build_services(
        self, cfg: ServiceConfig, engine: AsyncEngine
    ) -> Sequence[ServiceRegistration]:
        """The effect-owner RPCs."""
        del cfg
        kinds = served_kinds(load_effect_owner_settings())
        return [
            build_effect_owner_service(
                engine, kinds, on_accepted=self.commands.notify, seats=self.seats
            )
        ]

    async def start_background(self, cfg: ServiceConfig, engine: AsyncEngine) -> OwnerBackground:
        """The command dispatcher and the owner-outbox dispatcher, woken by this app."""
        return await start_owner_background(cfg, engine, app=self)


async def build_services(cfg: ServiceConfig, engine: AsyncEngine) -> Sequence[ServiceRegistration]:
    """The effect-owner RPCs (no wakeups: the loops poll)."""
    del cfg
    return [build_effect_owner_service(engine, served_kinds(load_effect_owner_settings()))]


def state_sources(cfg: ServiceConfig) -> Sequence[StateSource]:
    """The owner's authoritative-state gauges (commands by state; the owner outbox's
    are added by ``run_service``)."""
    return [CommandStateSource(count_cap=cfg.telemetry.count_cap)]


def receipt_family(
    cfg: ServiceConfig, settings: EffectOwnerSettings, outbox: OutboxSettings
) -> tuple[MessageFamily, object]:
    """The completion-receipt family and the channel it delivers over (to close)."""
    channel = peer_channel(cfg, settings.runtime_target, audience=ServiceName.RUNTIME)
    credentials = ScopedCredentials.from_config(
        cfg,
        audience=ServiceName.RUNTIME,
        subject="effect-owner",
        roles=(WAKE_SIGNAL_SUBMIT_ROLE,),
    )
    deliver = WakeSignalDelivery(channel, credentials, timeout_s=outbox.lease_ms / 1000 / 2)
    policy = DeliveryPolicy(
        max_attempts=settings.receipt_max_attempts,
        base_delay_ms=outbox.retry_base_ms,
        max_delay_ms=outbox.retry_max_ms,
        lease_ms=outbox.lease_ms,
        reconcile_max_attempts=outbox.reconcile_max_attempts,
    )
    return MessageFamily(EFFECT_COMPLETION_FAMILY, deliver, policy=policy), channel


class OwnerBackground:
    """The running loops of the owner process, and what they hold open."""

    def __init__(
        self,
        loops: LoopGroup,
        providers: ProviderSet,
        channel: object,
        receipts: OutboxDispatcher | None = None,
        commands: CommandDispatcher | None = None,
    ) -> None:
        self._loops, self._providers, self._channel = loops, providers, channel
        self._receipts = receipts
        self._commands = commands

    async def stop(self) -> None:
        """Stop the loops, settle handed commands (their provider calls) and then handed
        receipt deliveries, then close providers and the runtime channel (idempotent)."""
        await self._loops.stop()
        if self._commands is not None:
            await self._commands.settle()
        if self._receipts is not None:
            await self._receipts.settle()
        await self._providers.aclose()
        close = getattr(self._channel, "close", None)
        if close is not None:
            await close()


async def start_owner_background(
    cfg: ServiceConfig, engine: AsyncEngine, *, app: OwnerApp | None = None
) -> OwnerBackground:
    """Start the command dispatcher and the owner-outbox dispatcher (see the docstring);
    with ``app``, its wakeups end their idle waits."""
    settings = load_effect_owner_settings()
    outbox = load_outbox_settings()
    providers = build_providers(settings)
    host = f"{socket.gethostname()}:{os.getpid()}/{uuid.uuid4().hex[:8]}"
    tasks: list[BackgroundLoop] = []
    family, channel = receipt_family(cfg, settings, outbox)
    receipts: OutboxDispatcher | None = None
    dispatcher: CommandDispatcher | None = None
    if outbox.dispatchers > 0:
        receipts = OutboxDispatcher(
            engine,
            OWNER_OUTBOX,
            FamilyRegistry([family]),
            owner=host,
            idle_s=outbox.idle_ms / 1000,
            sweep_interval_s=outbox.sweep_ms / 1000,
        )
        tasks += receipts.loops("owner-outbox", wake=None if app is None else app.receipts)
    if settings.dispatchers > 0 and providers:
        dispatcher = CommandDispatcher(
            engine,
            providers,
            CommandPolicy(
                max_attempts=settings.max_attempts,
                reconcile_max_attempts=settings.reconcile_max_attempts,
                base_delay_ms=settings.retry_base_ms,
                max_delay_ms=settings.retry_max_ms,
                lease_ms=settings.lease_ms,
            ),
            owner=host,
            concurrency=settings.dispatchers,
            idle_s=settings.idle_ms / 1000,
            on_receipt=None if app is None else app.receipts.notify,
            # A receipt's message is enqueued leased to this process's receipt delivery
            # (when it runs woken) and handed to it after the commit (ADR 0004).
            receipts=receipts,
        )
        tasks += dispatcher.loops(wake=None if app is None else app.commands)
        if app is not None and settings.preclaim_command:
            app.seats.dispatcher = dispatcher
    # The request-dedupe ledger of the owner's RPCs keeps FLOW_REQUEST_RETENTION_HOURS.
    tasks.append(
        RequestRetention(
            engine,
            RequestLedger(owner_requests),
            retention=timedelta(hours=cfg.request_retention_hours),
        )
    )
    loops = LoopGroup(tasks).start()
    log.info(
        "effect owner background: kinds=%s command dispatchers=%d outbox=%d runtime=%s",
        ",".join(sorted(providers)),
        settings.dispatchers,
        outbox.dispatchers,
        settings.runtime_target,
    )
    return OwnerBackground(loops, providers, channel, receipts, dispatcher)
