"""A world for the owner's dispatcher tests: the owner service, REAL local SMTP and HTTP
servers, providers built from owner configuration pointing at them."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy.ext.asyncio import AsyncEngine

from effect_owner_svc.commands.model import CommandPolicy
from effect_owner_svc.commands.store import attempts_txn, get_command_txn
from effect_owner_svc.dispatcher.commands import CommandDispatcher, CommandSeats
from effect_owner_svc.providers.factory import ProviderSet, build_providers
from effect_owner_svc.receipts.outbox import OWNER_OUTBOX
from services.auth import TrustedRuntimeWorkScope
from services.config import load_effect_owner_settings
from services.db import transaction
from services.outbox import list_messages
from tests.integration.effects.harness import OwnerClient, Scope, envelope, running_owner
from tests.support.dbs import new_org
from tests.support.effect_servers import (
    ScriptedMailSink,
    WebhookReceiver,
    mail_sink,
    webhook_receiver,
)

__all__ = ["FAST", "WEBHOOK", "World", "accept", "scope_of", "world_with"]

FAST = CommandPolicy(
    max_attempts=3, reconcile_max_attempts=3, base_delay_ms=1, max_delay_ms=2, lease_ms=10_000
)
WEBHOOK = {"to": "ops", "event": "contact.welcomed"}


@dataclass
class World:
    owner: OwnerClient
    engine: AsyncEngine
    sink: ScriptedMailSink
    receiver: WebhookReceiver
    providers: ProviderSet

    def dispatcher(self, policy: CommandPolicy = FAST, concurrency: int = 8) -> CommandDispatcher:
        return CommandDispatcher(
            self.engine,
            self.providers,
            policy,
            owner="test",
            rng=random.Random(3),
            concurrency=concurrency,
        )

    async def drive(self, rounds: int = 30, policy: CommandPolicy = FAST) -> None:
        d = self.dispatcher(policy)
        for _ in range(rounds):
            if not await d.run_once():
                await asyncio.sleep(0.01)

    async def command(self, scope: Scope, command_id: str) -> Any:
        async with transaction(self.engine, readonly=True) as conn:
            cmd = await get_command_txn(conn, scope_of(scope), command_id=command_id)
            attempts = await attempts_txn(conn, scope.org_id, command_id)
        assert cmd is not None
        return cmd, attempts

    async def receipts(self, scope: Scope) -> list[Any]:
        async with transaction(self.engine, readonly=True) as conn:
            return await list_messages(conn, OWNER_OUTBOX, scope.org_id)


def scope_of(s: Scope) -> TrustedRuntimeWorkScope:
    return TrustedRuntimeWorkScope(
        s.org_id, s.app_installation_id, s.runtime_capability_id, s.runtime_work_binding_digest
    )


@asynccontextmanager
async def world_with(
    engine: AsyncEngine,
    private_key: Ed25519PrivateKey,
    tmp: Path,
    *,
    idempotent: bool = True,
    status: bool = False,
    on_accepted: Callable[[Any], None] | None = None,
    seats: CommandSeats | None = None,
) -> AsyncIterator[World]:
    sink, receiver = ScriptedMailSink(), WebhookReceiver()
    async with mail_sink(sink) as smtp_port, webhook_receiver(receiver) as base:
        settings = load_effect_owner_settings(
            {
                "FLOW_EFFECT_SMTP_PORT": str(smtp_port),
                "FLOW_EFFECT_SMTP_TIMEOUT_S": "5",
                "FLOW_EFFECT_WEBHOOK_URL": f"{base}/hook",
                "FLOW_EFFECT_WEBHOOK_STATUS_URL": f"{base}/status" if status else "",
                "FLOW_EFFECT_WEBHOOK_TIMEOUT_S": "5",
                "FLOW_EFFECT_WEBHOOK_IDEMPOTENT": "true" if idempotent else "false",
            }
        )
        providers = build_providers(settings)
        async with running_owner(
            engine, private_key, tmp, on_accepted=on_accepted, seats=seats
        ) as owner:
            try:
                yield World(owner, engine, sink, receiver, providers)
            finally:
                await providers.aclose()


async def accept(world: World, *, owner_kind: str = "email.smtp", **kw: Any) -> tuple[Scope, Any]:
    scope = Scope(new_org())
    payload = WEBHOOK if owner_kind == "webhook.http" else None
    env = envelope(scope, owner_kind=owner_kind, payload=payload, **kw)
    resp = await world.owner.accept(scope, env)
    return scope, resp
