"""The runtime's canonical-outbox dispatcher: the generic ``services.outbox`` dispatcher
over ``runtime_outbox`` with the ``flow.effect.submit`` family registered (§10.7).

There is no Flow-specific table, claimer, state machine or read path: the family is a
registration — ``deliver`` = ``AcceptHandoff``, ``reconcile`` = ``RejectIfUnaccepted``
(:mod:`runtime_svc.outbox.handoff`) and an optional **finalizer**
(``services.outbox.Finalizer``) that the Flow side supplies: after a Rejected or
AcceptanceUnknown owner receipt is persisted it converges the dependency, step and root
root-first in its own transaction and makes the message terminal with
``ticket.commit_txn(conn)`` last. Until a finalizer is registered such messages stay in
their pre-finalization state (never terminal non-delivery) and the repair sweep reports
them every pass.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid

import grpc.aio
from sqlalchemy.ext.asyncio import AsyncEngine

from runtime_svc.outbox import preclaim
from runtime_svc.outbox.handoff import EffectHandoff, owner_channels
from runtime_svc.outbox.table import RUNTIME_OUTBOX
from services.background import LoopGroup, Wakeup
from services.config import OutboxSettings, ServiceConfig, ServiceName, load_outbox_settings
from services.effect_contract import FLOW_EFFECT_SUBMIT_FAMILY, HANDOFF_SUBMIT_ROLE
from services.outbox import (
    DeliveryPolicy,
    FamilyRegistry,
    Finalizer,
    MessageFamily,
    OutboxDispatcher,
)
from services.peer_client import ScopedCredentials, peer_channel

__all__ = [
    "RuntimeOutbox",
    "delivery_policy",
    "flow_effect_submit_family",
    "start_runtime_outbox",
]

log = logging.getLogger(__name__)


def delivery_policy(settings: OutboxSettings) -> DeliveryPolicy:
    """The ``flow.effect.submit`` delivery budget, backoff and lease."""
    return DeliveryPolicy(
        max_attempts=settings.max_attempts,
        base_delay_ms=settings.retry_base_ms,
        max_delay_ms=settings.retry_max_ms,
        lease_ms=settings.lease_ms,
        reconcile_max_attempts=settings.reconcile_max_attempts,
    )


def flow_effect_submit_family(
    handoff: EffectHandoff, *, policy: DeliveryPolicy, finalizer: Finalizer | None = None
) -> MessageFamily:
    """The registration of the ``flow.effect.submit`` family."""
    return MessageFamily(
        FLOW_EFFECT_SUBMIT_FAMILY,
        handoff.deliver,
        reconcile=handoff.reconcile,
        finalizer=finalizer,
        policy=policy,
    )


class RuntimeOutbox:
    """The running dispatcher loops and the owner channels they opened."""

    def __init__(
        self,
        dispatcher: OutboxDispatcher,
        loops: LoopGroup,
        channels: list[grpc.aio.Channel],
        engine: AsyncEngine | None = None,
    ) -> None:
        self.dispatcher, self._loops, self._channels = dispatcher, loops, channels
        self._engine = engine

    async def stop(self) -> None:
        """Stop taking pre-claimed messages, stop the loops, then close the owner
        channels (idempotent)."""
        if self._engine is not None:
            preclaim.unregister(self._engine, self.dispatcher)
        await self._loops.stop()
        await self.dispatcher.settle()
        for channel in self._channels:
            await channel.close()
        self._channels.clear()


async def start_runtime_outbox(
    cfg: ServiceConfig,
    engine: AsyncEngine,
    *,
    finalizer: Finalizer | None = None,
    settings: OutboxSettings | None = None,
    wake: Wakeup | None = None,
) -> RuntimeOutbox | None:
    """Start delivering the canonical Runtime outbox (None when
    ``FLOW_OUTBOX_DISPATCHERS=0``).

    Args:
        cfg: the runtime's configuration (signing key, message limits).
        engine: the runtime database.
        finalizer: the Flow-side finalizer of the ``flow.effect.submit`` family.
        settings: overrides :func:`~services.config.load_outbox_settings`.
        wake: ends the delivery loop's idle wait (an EffectSubmit committed here).
    """
    s = settings or load_outbox_settings()
    if s.dispatchers <= 0:
        return None
    opened: list[grpc.aio.Channel] = []
    lookup, _ = owner_channels(
        s.owner_targets,
        lambda t: _remember(opened, peer_channel(cfg, t, audience=ServiceName.EFFECT_OWNER)),
    )
    credentials = ScopedCredentials.from_config(
        cfg, audience=ServiceName.EFFECT_OWNER, subject="runtime", roles=(HANDOFF_SUBMIT_ROLE,)
    )
    handoff = EffectHandoff(lookup, credentials, timeout_s=s.lease_ms / 1000 / 2)
    family = flow_effect_submit_family(handoff, policy=delivery_policy(s), finalizer=finalizer)
    dispatcher = OutboxDispatcher(
        engine,
        RUNTIME_OUTBOX,
        FamilyRegistry([family]),
        owner=f"{socket.gethostname()}:{os.getpid()}/{uuid.uuid4().hex[:8]}",
        concurrency=max(1, s.dispatchers) * 8,
        idle_s=s.idle_ms / 1000,
        sweep_interval_s=s.sweep_ms / 1000,
    )
    loops = LoopGroup(dispatcher.loops("runtime-outbox", wake=wake)).start()
    if wake is not None:
        # EffectSubmit commits of this process enqueue leased to it (ADR 0004).
        preclaim.register(engine, dispatcher)
    log.info(
        "runtime outbox dispatcher: owners %s, finalizer %s",
        dict(s.owner_targets),
        "registered" if finalizer is not None else "not registered yet",
    )
    return RuntimeOutbox(dispatcher, loops, opened, engine)


def _remember(opened: list[grpc.aio.Channel], channel: grpc.aio.Channel) -> grpc.aio.Channel:
    opened.append(channel)
    return channel
