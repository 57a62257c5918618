"""Hinted claims of the generic outbox (``services.outbox.hints``) on a real table
(``owner_outbox``), SQLite and MariaDB: a producer's wakeup names the message it
committed and the dispatcher claims exactly that row in one transaction — and a hint is
never more than a shortcut: stale, duplicate, foreign, not-due or never-committed hints
claim nothing, two dispatchers racing on one hint deliver once, and a lost hint still
delivers by polling."""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace
from datetime import timedelta

from sqlalchemy import update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from effect_owner_svc.receipts.outbox import OWNER_OUTBOX
from effect_owner_svc.schema import owner_outbox
from services.background import LoopGroup, Wakeup
from services.db import db_now, run_in_transaction, transaction
from services.digest import canonical_json, versioned_digest
from services.outbox import (
    Delivered,
    DeliveryPolicy,
    DeliveryResult,
    DeliveryState,
    FamilyRegistry,
    MessageFamily,
    NewOutboxMessage,
    OutboxDispatcher,
    OutboxHint,
    OutboxMessage,
    enqueue_txn,
    get_message,
    hint_of,
)
from tests.support.dbs import new_org

POLICY = DeliveryPolicy(
    max_attempts=3, base_delay_ms=1, max_delay_ms=2, lease_ms=30_000, reconcile_max_attempts=2
)


def _message(org: str, key: str = "k1") -> NewOutboxMessage:
    body = canonical_json({"n": 1}).decode()
    return NewOutboxMessage(
        org_id=org,
        app_installation_id="inst-1",
        runtime_capability_id="cap-1",
        runtime_work_binding_digest=versioned_digest("binding", [org]),
        message_id=f"msg-{key}",
        family=f"test.{org}",
        key=key,
        payload=body,
        payload_digest=versioned_digest("payload", body),
    )


class Consumer:
    """Counts deliveries; optionally holds each one until released."""

    def __init__(self) -> None:
        self.received: list[str] = []
        self.gate: asyncio.Event | None = None

    async def deliver(self, message: OutboxMessage) -> DeliveryResult:
        self.received.append(message.key)
        if self.gate is not None:
            await asyncio.wait_for(self.gate.wait(), timeout=10)
        return Delivered()


def _dispatcher(engine: AsyncEngine, org: str, consumer: Consumer, **kw: float) -> OutboxDispatcher:
    family = MessageFamily(f"test.{org}", consumer.deliver, policy=POLICY)
    return OutboxDispatcher(
        engine, OWNER_OUTBOX, FamilyRegistry([family]), owner="hinted", rng=random.Random(5), **kw
    )


async def _enqueue(engine: AsyncEngine, msg: NewOutboxMessage) -> OutboxHint:
    async def fn(conn: AsyncConnection) -> None:
        await enqueue_txn(conn, OWNER_OUTBOX, msg)

    await run_in_transaction(engine, fn)
    return hint_of(OWNER_OUTBOX, msg)


async def _state(engine: AsyncEngine, org: str, key: str = "k1") -> OutboxMessage:
    async with transaction(engine, readonly=True) as conn:
        found = await get_message(conn, OWNER_OUTBOX, org, f"msg-{key}")
    assert found is not None
    return found


async def test_a_hinted_message_is_claimed_and_delivered_without_discovery(
    engine: AsyncEngine,
) -> None:
    org = new_org()
    hint = await _enqueue(engine, _message(org))
    consumer = Consumer()
    d = _dispatcher(engine, org, consumer)

    async def no_discovery() -> int:
        raise AssertionError("a hinted claim must not run the discovery pass")

    d.deliver_once = no_discovery  # type: ignore[method-assign]
    assert await d.deliver_hinted([hint]) == 1
    msg = await _state(engine, org)
    assert msg.delivery_state is DeliveryState.DELIVERED and msg.delivery_attempts == 1
    assert consumer.received == ["k1"]
    # The same hint again (a duplicate notify) claims nothing: the row is no longer due.
    assert await d.deliver_hinted([hint]) == 0
    assert consumer.received == ["k1"]


async def test_hints_that_name_nothing_due_here_claim_nothing(engine: AsyncEngine) -> None:
    org = new_org()
    consumer = Consumer()
    d = _dispatcher(engine, org, consumer)
    # Never committed: the producer's transaction rolled back.
    ghost = hint_of(OWNER_OUTBOX, _message(org, "ghost"))
    # Another table's hint, and a non-hint object.
    foreign = replace(await _enqueue(engine, _message(org, "k2")), table="runtime_outbox")
    # Another family (not served by this dispatcher).
    other = new_org()
    theirs = await _enqueue(engine, _message(other, "k3"))
    # Not due yet (a retry scheduled in the future).
    later = await _enqueue(engine, _message(org, "k4"))

    async def postpone(conn: AsyncConnection) -> None:
        await conn.execute(
            update(owner_outbox)
            .where(owner_outbox.c.org_id == org, owner_outbox.c.message_key == "k4")
            .values(next_attempt_at=await db_now(conn) + timedelta(hours=1))
        )

    await run_in_transaction(engine, postpone)
    assert await d.deliver_hinted([ghost, foreign, theirs, later, object()]) == 0
    assert consumer.received == []
    for o, key in ((org, "k2"), (other, "k3"), (org, "k4")):
        msg = await _state(engine, o, key)
        assert msg.delivery_state is DeliveryState.PENDING and msg.lease_token is None


async def test_two_dispatchers_racing_on_one_hint_deliver_once(engine: AsyncEngine) -> None:
    org = new_org()
    hint = await _enqueue(engine, _message(org))
    consumer = Consumer()
    consumer.gate = asyncio.Event()
    a, b = _dispatcher(engine, org, consumer), _dispatcher(engine, org, consumer)
    first = asyncio.ensure_future(a.deliver_hinted([hint]))
    for _ in range(500):  # bounded: until a's delivery is in flight (claim committed)
        if consumer.received:
            break
        await asyncio.sleep(0.01)
    assert consumer.received == ["k1"]
    # b's hint and b's polling both find the row leased by a.
    assert await b.deliver_hinted([hint]) == 0
    assert await b.deliver_once() == 0
    consumer.gate.set()
    assert await asyncio.wait_for(first, timeout=10) == 1
    assert consumer.received == ["k1"]
    assert (await _state(engine, org)).delivery_state is DeliveryState.DELIVERED


async def test_a_lost_hint_is_still_delivered_by_polling(engine: AsyncEngine) -> None:
    org = new_org()
    consumer = Consumer()
    wake = Wakeup()
    d = _dispatcher(engine, org, consumer, idle_s=0.05)
    async with LoopGroup(d.loops("hinted", wake=wake)):
        # Committed, but the notify never happened (process restarted, hint dropped).
        await _enqueue(engine, _message(org, "lost"))
        # And one with its hint.
        wake.notify(await _enqueue(engine, _message(org, "hinted")))
        for _ in range(1000):  # bounded
            if len(consumer.received) == 2:
                break
            await asyncio.sleep(0.01)
    assert sorted(consumer.received) == ["hinted", "lost"]
    for key in ("lost", "hinted"):
        assert (await _state(engine, org, key)).delivery_state is DeliveryState.DELIVERED
