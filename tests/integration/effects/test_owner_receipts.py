"""Completion receipts delivered from the owner outbox to a WakeSignalService over real
gRPC (the production bootstrap verifies the owner's own credential: audience runtime,
role flow.signals.submit), on SQLite and MariaDB: delivered only after the runtime's
response, lost responses redelivered with the same wake token, one wake per receipt."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy.exc import DBAPIError

from effect_owner_svc.commands.store import get_command_txn
from effect_owner_svc.receipts.delivery import WakeSignalDelivery
from effect_owner_svc.receipts.outbox import OWNER_OUTBOX
from effect_owner_svc.receipts.store import write_receipt_txn
from services.config import ServiceName
from services.db import transaction
from services.effect_contract import (
    EFFECT_COMPLETION_FAMILY,
    EFFECT_COMPLETION_PRODUCER_KIND,
    WAKE_SIGNAL_SUBMIT_ROLE,
    CompletionEvidence,
    CompletionOutcomeCode,
)
from services.outbox import (
    DeliveryPolicy,
    DeliveryState,
    FamilyRegistry,
    MessageFamily,
    OutboxDispatcher,
    list_messages,
)
from services.peer_client import ScopedCredentials, peer_channel
from tests.integration.effects.harness import (
    KEY_ID,
    Scope,
    owner_config,
    running_wake_signals,
)
from tests.integration.effects.owner_world import World, accept, scope_of
from tests.support.effect_servers import FakeWakeSignals

FAST = DeliveryPolicy(max_attempts=5, base_delay_ms=1, max_delay_ms=2, lease_ms=10_000)


async def _deliver(
    world: World,
    fake: FakeWakeSignals,
    private_key: Ed25519PrivateKey,
    tmp: Path,
    *,
    rounds: int = 20,
    roles: Sequence[str] = (WAKE_SIGNAL_SUBMIT_ROLE,),
) -> None:
    async with running_wake_signals(fake, private_key, tmp) as server:
        channel = peer_channel(
            owner_config(tmp), f"127.0.0.1:{server.port}", audience=ServiceName.RUNTIME
        )
        creds = ScopedCredentials(
            private_key,
            KEY_ID,
            audience=ServiceName.RUNTIME,
            subject="effect-owner",
            roles=roles,
        )
        family = MessageFamily(
            EFFECT_COMPLETION_FAMILY, WakeSignalDelivery(channel, creds, timeout_s=5), policy=FAST
        )
        d = OutboxDispatcher(
            world.engine, OWNER_OUTBOX, FamilyRegistry([family]), owner="t", rng=random.Random(1)
        )
        try:
            for _ in range(rounds):
                if not await d.deliver_once():
                    await asyncio.sleep(0.01)
        finally:
            await channel.close()


async def _messages(world: World, scope: Scope) -> list[Any]:
    async with transaction(world.engine, readonly=True) as conn:
        return await list_messages(conn, OWNER_OUTBOX, scope.org_id)


async def test_a_receipt_becomes_one_wake_signal_and_is_delivered_after_the_response(
    world: World, private_key: Ed25519PrivateKey, tmp_path: Path
) -> None:
    scope, resp = await accept(world)
    await world.drive()
    fake = FakeWakeSignals()
    await _deliver(world, fake, private_key, tmp_path)
    [msg] = await _messages(world, scope)
    assert msg.delivery_state is DeliveryState.DELIVERED
    [signal] = fake.signals.values()
    assert signal.producer_kind == EFFECT_COMPLETION_PRODUCER_KIND
    assert signal.producer_key == resp.command.effect_handoff_key
    assert signal.wake_token == f"{resp.command.command_id}/1" and signal.wake_version == 1
    evidence = CompletionEvidence.from_json(signal.evidence_json)
    assert evidence.command_id == resp.command.command_id
    assert evidence.effect_owner_kind == "email.smtp"
    assert signal.scope.org_id == scope.org_id


async def test_a_lost_response_is_redelivered_with_the_same_token_and_wakes_once(
    world: World, private_key: Ed25519PrivateKey, tmp_path: Path
) -> None:
    scope, _ = await accept(world)
    await world.drive()
    fake = FakeWakeSignals(lose_responses=1, unavailable=1)
    await _deliver(world, fake, private_key, tmp_path)
    [msg] = await _messages(world, scope)
    assert msg.delivery_state is DeliveryState.DELIVERED
    assert msg.delivery_attempts == 3  # unavailable, committed-but-lost, duplicate ack
    assert fake.calls == 3 and len(fake.signals) == 1


async def test_the_runtime_refusing_the_credential_dead_letters_for_an_operator(
    world: World, private_key: Ed25519PrivateKey, tmp_path: Path
) -> None:
    scope, _ = await accept(world)
    await world.drive()
    fake = FakeWakeSignals()
    await _deliver(world, fake, private_key, tmp_path, roles=())
    [msg] = await _messages(world, scope)
    assert msg.delivery_state is DeliveryState.DEAD_LETTERED
    assert msg.last_error_code == "runtime_permission_denied"
    assert fake.signals == {}


async def test_a_duplicate_receipt_cannot_be_written(world: World) -> None:
    scope, resp = await accept(world)
    await world.drive()
    async with transaction(world.engine, readonly=True) as conn:
        cmd = await get_command_txn(conn, scope_of(scope), command_id=resp.command.command_id)
    assert cmd is not None
    evidence = CompletionEvidence(
        command_id=cmd.command_id,
        outcome_version=1,
        outcome=CompletionOutcomeCode.SUCCEEDED,
        effect_owner_kind=cmd.effect_owner_kind,
        effect_handoff_key=cmd.effect_handoff_key,
    )
    with pytest.raises(DBAPIError):
        async with transaction(world.engine) as conn:
            await write_receipt_txn(conn, cmd, evidence, cmd.updated_at)
    assert len(await _messages(world, scope)) == 1
