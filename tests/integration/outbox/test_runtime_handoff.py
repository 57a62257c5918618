"""The runtime's canonical-outbox dispatcher for ``flow.effect.submit`` against the real
effect owner over gRPC (both with their own databases, SQLite or MariaDB): delivery only
after a matching accepted receipt, lost acknowledgements retried with the same key,
budget exhaustion reconciled through ``RejectIfUnaccepted``, and Rejected /
AcceptanceUnknown handed to the family finalizer before anything becomes terminal."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy.ext.asyncio import AsyncEngine

from effect_owner_svc.api.servicer import EffectOwnerServicer
from effect_owner_svc.schema import external_commands, owner_inbox
from runtime_svc.outbox import (
    RUNTIME_OUTBOX,
    EffectHandoff,
    enqueue_effect_submit_txn,
    flow_effect_submit_family,
    owner_channels,
)
from services import db
from services.auth import CredentialVerifier, generate_keypair
from services.config import ServiceName
from services.db import run_in_transaction, transaction
from services.effect_contract import HANDOFF_SUBMIT_ROLE
from services.grpc_server import ServiceRegistration, start_server
from services.outbox import (
    DeliveryPolicy,
    DeliveryState,
    FamilyRegistry,
    FinalizationTicket,
    OutboxDispatcher,
    OutboxMessage,
    get_message,
)
from services.peer_client import ScopedCredentials
from services.proto import effect_v1
from tests.integration.effects.harness import KEY_ID, Scope, count, owner_config, submit_intent
from tests.support.dbs import migrated_database, new_org
from tests.support.procs import free_port

FAST = DeliveryPolicy(
    max_attempts=3, base_delay_ms=1, max_delay_ms=2, lease_ms=10_000, reconcile_max_attempts=3
)
_BACKENDS = ["sqlite", pytest.param("mariadb", marks=pytest.mark.mariadb)]


@dataclass(frozen=True)
class Databases:
    runtime: str
    owner: str


@pytest.fixture(scope="module", params=_BACKENDS, ids=["sqlite", "mariadb"])
def databases(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Databases]:
    with (
        migrated_database(request, tmp_path_factory, "runtime_svc") as runtime,
        migrated_database(request, tmp_path_factory, "effect_owner_svc") as owner,
    ):
        yield Databases(runtime, owner)


class FlakyOwner(EffectOwnerServicer):
    """The real owner servicer whose responses can be lost after it committed, or whose
    receipts can be tampered with (a broken or hostile owner)."""

    lose_accept: int = 0
    tamper: bool = False

    async def AcceptHandoff(self, request: Any, context: Any) -> Any:
        resp = await super().AcceptHandoff(request, context)
        if self.lose_accept > 0:
            self.lose_accept -= 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset")
        if self.tamper:
            resp.fence.payload_digest = "effect-payload/v1:sha256:" + "0" * 64
        return resp

    async def RejectIfUnaccepted(self, request: Any, context: Any) -> Any:
        resp = await super().RejectIfUnaccepted(request, context)
        if self.tamper:
            resp.fence.runtime_outbox_message_id = "rob_other"
        return resp


@dataclass
class FakeFinalizer:
    """Stands in for the Flow-side root-first finalizer: records its call and makes the
    message terminal last in its own transaction on the runtime database."""

    engine: AsyncEngine
    calls: list[tuple[str, str]] = field(default_factory=list)

    def of(self, key: str) -> list[str]:
        """Dispositions this finalizer applied to ``key`` (the module database is shared:
        a dispatcher also repairs other tests' leftovers, as it must)."""
        return [d for k, d in self.calls if k == key]

    async def finalize(self, ticket: FinalizationTicket) -> None:
        async with transaction(self.engine) as conn:
            # (the real finalizer locks root → completion step → dependency here)
            await ticket.commit_txn(conn)
        self.calls.append((ticket.message.key, ticket.disposition.value))


@dataclass
class World:
    runtime: AsyncEngine
    owner_engine: AsyncEngine
    owner: FlakyOwner
    owner_port: int
    private_key: Ed25519PrivateKey
    finalizer: FakeFinalizer
    channels: list[Any] = field(default_factory=list)

    def dispatcher(
        self, *, targets: dict[str, str] | None = None, finalize: bool = True
    ) -> OutboxDispatcher:
        def open_channel(target: str) -> Any:
            ch = grpc.aio.insecure_channel(target)
            self.channels.append(ch)
            return ch

        lookup, _ = owner_channels(
            targets if targets is not None else {"*": f"127.0.0.1:{self.owner_port}"},
            open_channel,
        )
        creds = ScopedCredentials(
            self.private_key,
            KEY_ID,
            audience=ServiceName.EFFECT_OWNER,
            subject="runtime",
            roles=(HANDOFF_SUBMIT_ROLE,),
        )
        family = flow_effect_submit_family(
            EffectHandoff(lookup, creds, timeout_s=5),
            policy=FAST,
            finalizer=self.finalizer if finalize else None,
        )
        return OutboxDispatcher(
            self.runtime, RUNTIME_OUTBOX, FamilyRegistry([family]), owner="rt", rng=random.Random(5)
        )

    async def enqueue(
        self, scope: Scope, *, owner_kind: str = "email.smtp", run: str = "run-1"
    ) -> Any:
        deadline = datetime.now(UTC) + timedelta(hours=1)
        intent = submit_intent(scope, run=run, owner_kind=owner_kind, deadline=deadline)
        await run_in_transaction(self.runtime, lambda c: enqueue_effect_submit_txn(c, intent))
        return intent

    async def message(self, scope: Scope, intent: Any) -> OutboxMessage:
        async with transaction(self.runtime, readonly=True) as conn:
            found = await get_message(conn, RUNTIME_OUTBOX, scope.org_id, intent.message_id)
        assert found is not None
        return found

    async def drive(self, d: OutboxDispatcher, until: Any, rounds: int = 40) -> None:
        for _ in range(rounds):
            if await until():
                return
            await d.deliver_once()
            await d.sweep_once()
            await asyncio.sleep(0.01)
        assert await until(), "condition not reached within bounded rounds"


@pytest.fixture
async def world(databases: Databases, tmp_path: Path) -> AsyncIterator[World]:
    key = generate_keypair()[0]
    runtime = db.create_engine(databases.runtime, pool_size=6)
    owner_engine = db.create_engine(databases.owner, pool_size=6)
    servicer = FlakyOwner(owner_engine, ["email.smtp", "webhook.http"])
    verifier = CredentialVerifier({KEY_ID: key.public_key()}, ServiceName.EFFECT_OWNER)
    server = await start_server(
        owner_config(tmp_path),
        [
            ServiceRegistration(
                "nexus.flow.effect.v1.EffectOwnerService",
                effect_v1.add_EffectOwnerServiceServicer_to_server,
                servicer,
            )
        ],
        verifier=verifier,
    )
    w = World(runtime, owner_engine, servicer, server.port, key, FakeFinalizer(runtime))
    try:
        yield w
    finally:
        for ch in w.channels:
            await ch.close()
        await server.stop(0)
        await runtime.dispose()
        await owner_engine.dispose()


async def test_no_owner_command_exists_before_the_runtime_transaction_commits(
    world: World,
) -> None:
    scope = Scope(new_org())
    d = world.dispatcher()
    intent = submit_intent(scope)
    async with transaction(world.runtime) as conn:
        await enqueue_effect_submit_txn(conn, intent)
        if world.runtime.dialect.name != "sqlite":  # SQLite's one writer would block here
            await d.deliver_once()
            assert await count(world.owner_engine, external_commands, org_id=scope.org_id) == 0
    assert await count(world.owner_engine, external_commands, org_id=scope.org_id) == 0

    async def delivered() -> bool:
        return (await world.message(scope, intent)).delivery_state is DeliveryState.DELIVERED

    await world.drive(d, delivered)
    assert await count(world.owner_engine, external_commands, org_id=scope.org_id) == 1


async def test_delivered_only_with_a_matching_accepted_receipt(world: World) -> None:
    scope = Scope(new_org())
    intent = await world.enqueue(scope)
    d = world.dispatcher()

    async def delivered() -> bool:
        return (await world.message(scope, intent)).delivery_state is DeliveryState.DELIVERED

    await world.drive(d, delivered)
    msg = await world.message(scope, intent)
    assert msg.delivery_attempts == 1 and msg.last_error_code is None
    async with transaction(world.owner_engine, readonly=True) as conn:
        from sqlalchemy import select

        row = (
            (
                await conn.execute(
                    select(external_commands).where(external_commands.c.org_id == scope.org_id)
                )
            )
            .mappings()
            .one()
        )
    assert row["effect_handoff_key"] == intent.handoff_key
    assert row["runtime_outbox_message_id"] == intent.message_id
    assert row["payload_digest"] == intent.payload_digest
    assert row["flow_run_id"] == "run-1" and row["failure_policy"] == "fault_path"


async def test_a_lost_acknowledgement_retries_the_same_key_into_one_command(
    world: World,
) -> None:
    scope = Scope(new_org())
    world.owner.lose_accept = 2
    intent = await world.enqueue(scope)
    d = world.dispatcher()

    async def delivered() -> bool:
        return (await world.message(scope, intent)).delivery_state is DeliveryState.DELIVERED

    await world.drive(d, delivered)
    assert (await world.message(scope, intent)).delivery_attempts == 3
    assert await count(world.owner_engine, external_commands, org_id=scope.org_id) == 1
    assert await count(world.owner_engine, owner_inbox, org_id=scope.org_id) == 1


async def test_budget_exhaustion_reconciles_and_an_accepted_fence_repairs_delivery(
    world: World,
) -> None:
    scope = Scope(new_org())
    world.owner.lose_accept = FAST.max_attempts  # every delivery's answer is lost
    intent = await world.enqueue(scope)
    d = world.dispatcher()

    async def delivered() -> bool:
        return (await world.message(scope, intent)).delivery_state is DeliveryState.DELIVERED

    await world.drive(d, delivered)
    msg = await world.message(scope, intent)
    assert msg.delivery_attempts == FAST.max_attempts + 1  # + one reconciliation
    assert world.finalizer.of(intent.handoff_key) == []
    assert await count(world.owner_engine, external_commands, org_id=scope.org_id) == 1


async def test_proven_rejection_goes_to_the_finalizer_before_it_is_terminal(
    world: World,
) -> None:
    scope = Scope(new_org())
    intent = await world.enqueue(scope, owner_kind="sms.unserved")
    d = world.dispatcher()

    async def finalized() -> bool:
        return bool(world.finalizer.of(intent.handoff_key))

    await world.drive(d, finalized)
    msg = await world.message(scope, intent)
    assert world.finalizer.of(intent.handoff_key) == ["rejected"]
    assert msg.delivery_state is DeliveryState.HANDOFF_REJECTED
    # The owner holds the durable tombstone and no command; a late delivery is refused.
    assert await count(world.owner_engine, owner_inbox, org_id=scope.org_id, state="REJECTED") == 1
    assert await count(world.owner_engine, external_commands, org_id=scope.org_id) == 0


async def test_without_a_finalizer_a_rejected_handoff_never_becomes_terminal(
    world: World,
) -> None:
    scope = Scope(new_org())
    intent = await world.enqueue(scope, owner_kind="sms.unserved")
    d = world.dispatcher(finalize=False)

    async def pre_final() -> bool:
        return (await world.message(scope, intent)).delivery_state is DeliveryState.REJECTED

    await world.drive(d, pre_final)
    for _ in range(3):
        await d.sweep_once()
    assert (await world.message(scope, intent)).delivery_state is DeliveryState.REJECTED


async def test_an_unreachable_owner_is_acceptance_unknown_never_rejection(world: World) -> None:
    scope = Scope(new_org())
    intent = await world.enqueue(scope)
    d = world.dispatcher(targets={"*": f"127.0.0.1:{free_port()}"})

    async def finalized() -> bool:
        return bool(world.finalizer.of(intent.handoff_key))

    await world.drive(d, finalized, rounds=80)
    msg = await world.message(scope, intent)
    assert world.finalizer.of(intent.handoff_key) == ["unknown"]
    assert msg.delivery_state is DeliveryState.DEAD_LETTERED
    assert msg.last_error_code == "reconciliation_exhausted"


async def test_an_owner_kind_without_a_configured_owner_is_never_routed(world: World) -> None:
    scope = Scope(new_org())
    intent = await world.enqueue(scope, owner_kind="webhook.http")
    d = world.dispatcher(targets={"email.smtp": f"127.0.0.1:{world.owner_port}"})

    async def finalized() -> bool:
        return bool(world.finalizer.of(intent.handoff_key))

    await world.drive(d, finalized)
    msg = await world.message(scope, intent)
    assert msg.delivery_state is DeliveryState.DEAD_LETTERED
    assert msg.last_error_code == "owner_kind_unroutable"
    assert await count(world.owner_engine, owner_inbox, org_id=scope.org_id) == 0


async def test_a_receipt_that_does_not_match_the_message_is_not_an_acknowledgement(
    world: World,
) -> None:
    scope = Scope(new_org())
    world.owner.tamper = True
    intent = await world.enqueue(scope)
    d = world.dispatcher()

    async def finalized() -> bool:
        return bool(world.finalizer.of(intent.handoff_key))

    await world.drive(d, finalized)
    msg = await world.message(scope, intent)
    assert msg.delivery_state is DeliveryState.DEAD_LETTERED
    assert msg.last_error_code == "receipt_mismatch"
    assert world.finalizer.of(intent.handoff_key) == ["unknown"]
